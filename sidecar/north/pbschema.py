"""JSON Schema of the OpenEngine messages the north protocol embeds, in their proto3 JSON form.

Built from the same compiled betterproto2 classes (and the same mapping rules) that
``sidecar.north.pbjson`` reads and writes them with, so the published schema cannot drift from
what the codec does. Each message has two definitions:

- ``openengine.v1.<Name>``: what the sidecar **writes** (``message_to_json``): lowerCamelCase
  names, 64-bit integers as decimal strings, enums by name (an unknown number as a number),
  bytes as base64, non-finite floats as ``"NaN"`` / ``"Infinity"`` / ``"-Infinity"``, at most
  one member of a oneof, no other fields.
- ``input.openengine.v1.<Name>``: what the sidecar **accepts** (``message_from_json``): the
  proto field names too, ``null`` for "absent", integers as numbers or decimal strings,
  enums by name or number. (Rules a JSON Schema does not express -- a name given twice in
  both spellings, two members of a oneof, 32 levels of nesting -- are still the codec's.)

:func:`definitions` returns the definitions a set of root messages needs (their closure);
:func:`ref` is the ``$ref`` of one.
"""

from __future__ import annotations

from typing import Final, Literal

import betterproto2
from betterproto2 import casing

from sidecar.json_types import JSONObject, JSONValue
from sidecar.openengine import pb
from sidecar.openengine.schema._betterproto2_internals import fields as message_fields

__all__ = ["DEFS", "Direction", "def_name", "definitions", "ref"]

Direction = Literal["in", "out"]

#: Where the definitions live in the published schema.
DEFS: Final = "#/$defs/"

_INT_RANGES: Final[dict[str, tuple[int, int]]] = {
    betterproto2.TYPE_INT32: (-(2**31), 2**31 - 1),
    betterproto2.TYPE_SINT32: (-(2**31), 2**31 - 1),
    betterproto2.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    betterproto2.TYPE_UINT32: (0, 2**32 - 1),
    betterproto2.TYPE_FIXED32: (0, 2**32 - 1),
}
_INT64: Final = {
    betterproto2.TYPE_INT64: "int64",
    betterproto2.TYPE_SINT64: "int64",
    betterproto2.TYPE_SFIXED64: "int64",
    betterproto2.TYPE_UINT64: "uint64",
    betterproto2.TYPE_FIXED64: "uint64",
}
_SIGNED_DIGITS: Final = "^(0|-?[1-9][0-9]*)$"
_UNSIGNED_DIGITS: Final = "^(0|[1-9][0-9]*)$"
_INPUT_DIGITS: Final = "^-?[0-9]+$"
_INPUT_FLOAT: Final = r"^(NaN|-?Infinity|[-+]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?)$"
_BASE64_OUT: Final = "^[A-Za-z0-9+/]*={0,2}$"
_BASE64_IN: Final = "^[A-Za-z0-9+/_-]*={0,2}$"
_JSON_VALUE: Final[JSONObject] = {}  # google.protobuf.Value: any JSON value
_WELL_KNOWN: Final[dict[type, JSONObject]] = {
    pb.Struct: {"type": "object"},
    pb.Value: _JSON_VALUE,
    pb.ListValue: {"type": "array"},
}


def def_name(cls: type[betterproto2.Message], direction: Direction) -> str:
    """Name of ``cls``'s definition in ``$defs``."""
    name = f"openengine.v1.{cls.__name__}"
    return name if direction == "out" else f"input.{name}"


def ref(cls: type[betterproto2.Message], direction: Direction) -> JSONObject:
    """``{"$ref": ...}`` to ``cls``'s definition (a well-known type inline)."""
    inline = _WELL_KNOWN.get(cls)
    if inline is not None:
        return dict(inline)
    return {"$ref": DEFS + def_name(cls, direction)}


def _enum(enum_cls: type[betterproto2.Enum], direction: Direction) -> JSONObject:
    names: list[JSONValue] = [m.proto_name or m.name for m in enum_cls]
    if direction == "out":  # a number this build does not know stays a number
        return {"anyOf": [{"enum": names}, {"type": "integer"}]}
    return {"anyOf": [{"enum": names}, {"type": "integer", "minimum": -(2**31), "maximum": 2**31 - 1}]}


def _scalar(
    proto_type: str, field_cls: type, direction: Direction, todo: list[type[betterproto2.Message]]
) -> JSONObject:
    if proto_type == betterproto2.TYPE_MESSAGE:
        assert issubclass(field_cls, betterproto2.Message)
        if field_cls not in _WELL_KNOWN:
            todo.append(field_cls)
        return ref(field_cls, direction)
    if proto_type == betterproto2.TYPE_ENUM:
        assert issubclass(field_cls, betterproto2.Enum)
        return _enum(field_cls, direction)
    if proto_type == betterproto2.TYPE_STRING:
        return {"type": "string"}
    if proto_type == betterproto2.TYPE_BOOL:
        return {"type": "boolean"}
    if proto_type == betterproto2.TYPE_BYTES:
        return {
            "type": "string",
            "contentEncoding": "base64",
            "pattern": _BASE64_OUT if direction == "out" else _BASE64_IN,
        }
    if proto_type in (betterproto2.TYPE_FLOAT, betterproto2.TYPE_DOUBLE):
        if direction == "out":
            return {"anyOf": [{"type": "number"}, {"enum": ["NaN", "Infinity", "-Infinity"]}]}
        return {"anyOf": [{"type": "number"}, {"type": "string", "pattern": _INPUT_FLOAT}]}
    if proto_type in _INT64:
        kind = _INT64[proto_type]
        if direction == "out":
            pattern = _UNSIGNED_DIGITS if kind == "uint64" else _SIGNED_DIGITS
            return {"type": "string", "pattern": pattern, "description": f"{kind} as a decimal string"}
        return {"anyOf": [{"type": "integer"}, {"type": "string", "pattern": _INPUT_DIGITS}]}
    lo, hi = _INT_RANGES[proto_type]
    number: JSONObject = {"type": "integer", "minimum": lo, "maximum": hi}
    if direction == "out":
        return number
    return {"anyOf": [number, {"type": "string", "pattern": _INPUT_DIGITS}]}


def _message(
    cls: type[betterproto2.Message], direction: Direction, todo: list[type[betterproto2.Message]]
) -> JSONObject:
    properties: JSONObject = {}
    groups: dict[str, list[str]] = {}
    for f in message_fields(cls):
        attr = f.name
        if f.map_value is not None:
            key_type = f.map_key_type
            value = _scalar(f.map_value.proto_type, f.map_value.cls, direction, todo)
            keys: JSONObject = {"type": "string"}
            if key_type in _INT_RANGES or key_type in _INT64:
                keys["pattern"] = _INPUT_DIGITS
            elif key_type == betterproto2.TYPE_BOOL:
                keys["enum"] = ["true", "false"]
            schema: JSONObject = {"type": "object", "propertyNames": keys, "additionalProperties": value}
        else:
            schema = _scalar(f.proto_type, f.cls, direction, todo)
            if f.repeated:
                schema = {"type": "array", "items": schema}
        json_name = casing.camel_case(attr.rstrip("_"))
        if f.group is not None:
            groups.setdefault(f.group, []).append(json_name)
        if direction == "in":
            schema = {"anyOf": [schema, {"type": "null"}]}
            properties[attr.rstrip("_")] = schema
        properties[json_name] = schema
    out: JSONObject = {
        "title": cls.__name__,
        "type": "object",
        "properties": properties,
        "additionalProperties": False,
    }
    if direction == "out":
        pairs: list[JSONValue] = [
            {"required": [a, b]}
            for members in groups.values()
            for i, a in enumerate(members)
            for b in members[i + 1 :]
        ]
        if pairs:
            out["not"] = {"anyOf": pairs}  # at most one member of each oneof
    return out


def definitions(roots: list[tuple[type[betterproto2.Message], Direction]]) -> JSONObject:
    """The ``$defs`` entries ``roots`` need: each root message and every message it contains."""
    out: JSONObject = {}
    for root, direction in roots:
        todo: list[type[betterproto2.Message]] = [root]
        while todo:
            cls = todo.pop()
            name = def_name(cls, direction)
            if cls in _WELL_KNOWN or name in out:
                continue
            out[name] = _message(cls, direction, todo)
    return dict(sorted(out.items()))
