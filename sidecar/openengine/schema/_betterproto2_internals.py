"""Every private name of betterproto2 the sidecar uses: here only.

betterproto2 0.10 (pinned ``>=0.10,<0.11``) has no public API for two things the sidecar needs:

- **A message class's field table** (``Message._betterproto``: ``ProtoClassMetadata`` with
  ``sorted_field_names``, ``meta_by_field_name`` — number, proto type, repeated, optional,
  oneof group, map key/value types — ``cls_by_field`` and ``default_gen``). The strict wire
  check (:mod:`sidecar.openengine.schema.protobuf_wire`), the proto3-JSON mapping and the north JSON
  Schema (``sidecar.north.pbjson``, ``sidecar.north.pbschema``) walk it. :func:`fields` gives
  it as plain :class:`Field` records.
- **A message's unknown-field buffer** (``Message._unknown_fields``: the bytes of fields the
  class does not know, kept from ``parse`` and written back verbatim by ``bytes()``). A
  ``KvSessionRef`` a client hands over is spliced into a request byte for byte through it, and
  a rebuilt request keeps a newer schema revision's fields (:func:`unknown_fields`,
  :func:`set_unknown_fields`).

:func:`missing_internals` lists what a release lacks; ``tests/openengine/test_betterproto2_internals.py``
asserts it is empty and checks the behaviour relied on, so an upgrade that changes it fails
there, loudly.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import betterproto2

__all__ = ["Field", "fields", "fields_by_number", "missing_internals", "set_unknown_fields", "unknown_fields"]


@dataclass(frozen=True, slots=True)
class Field:
    """One field of a message class, as betterproto2 describes it."""

    #: The Python attribute (a trailing ``_`` where the proto name is a keyword).
    name: str
    number: int
    #: ``betterproto2.TYPE_*`` (``"message"``, ``"enum"``, ``"string"``, ``"map"``, ...).
    proto_type: str
    repeated: bool
    #: Explicit presence (``optional`` in the schema).
    optional: bool
    #: The oneof group, if any.
    group: str | None
    #: The field's Python type: a message or enum class, a scalar type, or for a map its entry
    #: message (``key`` = 1, ``value`` = 2).
    cls: type
    #: Map fields: the key's proto type, and the value as a field of its own (number 2).
    map_key_type: str | None = None
    map_value: Field | None = None
    #: A factory of the field's default value (None for a map value).
    default: Callable[[], Any] | None = None


def _meta(cls: type[betterproto2.Message]) -> Any:
    return cls._betterproto  # type: ignore[arg-type]  # a classproperty, unknown to mypy


@functools.cache
def fields(cls: type[betterproto2.Message]) -> tuple[Field, ...]:
    """The fields of message class ``cls`` in field-number order."""
    meta = _meta(cls)
    out: list[Field] = []
    for name in meta.sorted_field_names:
        fmeta = meta.meta_by_field_name[name]
        key_type: str | None = None
        value: Field | None = None
        if fmeta.map_meta:
            key_meta, value_meta = fmeta.map_meta
            key_type = key_meta.proto_type
            value = Field(
                name=f"{name}.value",
                number=2,
                proto_type=value_meta.proto_type,
                repeated=False,
                optional=False,
                group=None,
                cls=meta.cls_by_field[f"{name}.value"],
            )
        out.append(
            Field(
                name=name,
                number=fmeta.number,
                proto_type=fmeta.proto_type,
                repeated=bool(fmeta.repeated),
                optional=bool(fmeta.optional),
                group=fmeta.group,
                cls=meta.cls_by_field[name],
                map_key_type=key_type,
                map_value=value,
                default=meta.default_gen[name],
            )
        )
    return tuple(out)


@functools.cache
def fields_by_number(cls: type[betterproto2.Message]) -> Mapping[int, Field]:
    """The fields of message class ``cls`` by field number."""
    return {f.number: f for f in fields(cls)}


def unknown_fields(message: betterproto2.Message) -> bytes:
    """The wire bytes of the fields ``message``'s class does not know (kept from ``parse``)."""
    data: bytes = getattr(message, "_unknown_fields", b"")
    return data


def set_unknown_fields(message: betterproto2.Message, data: bytes) -> None:
    """Make ``data`` (well-formed fields, in wire format) ``message``'s unknown fields:
    ``bytes(message)`` writes them verbatim after its known fields."""
    message._unknown_fields = data


def missing_internals() -> list[str]:
    """The betterproto2 internals above that this release lacks (empty when all are there)."""
    missing: list[str] = []
    probe = betterproto2.Message
    meta_names = ("sorted_field_names", "meta_by_field_name", "cls_by_field", "default_gen")
    meta_cls: Any = getattr(betterproto2, "ProtoClassMetadata", None)
    if meta_cls is None:
        missing.append("ProtoClassMetadata")
    else:
        missing += [f"ProtoClassMetadata.{n}" for n in meta_names if n not in meta_cls.__slots__]
    field_meta: Any = getattr(betterproto2, "FieldMetadata", None)
    if field_meta is None:
        missing.append("FieldMetadata")
    else:
        wanted = ("number", "proto_type", "map_meta", "group", "optional", "repeated")
        missing += [f"FieldMetadata.{n}" for n in wanted if n not in field_meta.__dataclass_fields__]
    if "_betterproto" not in dir(probe):
        missing.append("Message._betterproto")
    if not isinstance(getattr(_FieldProbe(), "_unknown_fields", None), bytes):
        missing.append("Message._unknown_fields")
    return missing


@dataclass(eq=False, repr=False)
class _FieldProbe(betterproto2.Message):
    """An empty message class, to look at a message instance."""
