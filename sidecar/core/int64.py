"""64-bit integers of the north protocol's answers: decimal strings, as proto3 JSON has them.

A JSON number above 2^53 loses digits in most JSON implementations (JavaScript's among
them), so docs/PROTOCOL.md promises every ``int64`` / ``uint64`` as a decimal string, in
JSON and msgpack alike. The sidecar's own answer Structs (the worker card, the load
status) declare such fields as :class:`Uint64` / :class:`Int64`: plain ``int`` subclasses
for Python code, which msgspec cannot encode by itself -- so every encoder of north
answers is built with :func:`enc_hook` (it turns them into strings), and an encoder that
forgets it fails loudly instead of sending a number. :func:`dec_hook` reads them back
(from a string or a number), :func:`schema_hook` describes them in the JSON Schema.

The generic proto3 JSON writer (``sidecar.north.pbjson``) stringifies pb messages' 64-bit
fields by itself; this module is for the Structs the sidecar builds.
"""

from __future__ import annotations

import re
from typing import Final, TypeVar

import msgspec

from sidecar.json_types import JSONObject

__all__ = [
    "INT64_PATTERN",
    "UINT64_PATTERN",
    "Int64",
    "Uint64",
    "dec_hook",
    "enc_hook",
    "i64",
    "json_decode",
    "json_encoder",
    "msgpack_encoder",
    "schema_hook",
    "u64",
]

#: JSON Schema patterns of the decimal strings (what the sidecar writes: no sign on uint64,
#: no leading zeros, no spaces).
UINT64_PATTERN: Final = "^(0|[1-9][0-9]*)$"
INT64_PATTERN: Final = "^(0|-?[1-9][0-9]*)$"
_UINT64_MAX: Final = 2**64 - 1
_INT64_RANGE: Final = (-(2**63), 2**63 - 1)
_DIGITS = re.compile(r"-?[0-9]{1,20}")


class Uint64(int):
    """A ``uint64`` field of a north answer (encoded as a decimal string)."""

    __slots__ = ()


class Int64(int):
    """An ``int64`` field of a north answer (encoded as a decimal string)."""

    __slots__ = ()


def u64(value: int | None) -> Uint64 | None:
    """``value`` as a :class:`Uint64` (``None`` stays ``None``: presence is kept)."""
    return None if value is None else Uint64(value)


def i64(value: int | None) -> Int64 | None:
    """``value`` as an :class:`Int64` (``None`` stays ``None``)."""
    return None if value is None else Int64(value)


def enc_hook(obj: object) -> str:
    """msgspec ``enc_hook`` of every north encoder: 64-bit integers as decimal strings."""
    if type(obj) is Uint64 or type(obj) is Int64:  # msgspec encodes exact ints itself
        return int.__repr__(obj)
    raise NotImplementedError(f"cannot encode objects of type {type(obj).__name__}")


def dec_hook(type_: type, obj: object) -> int:
    """msgspec ``dec_hook``: a :class:`Uint64` / :class:`Int64` from a decimal string or a number."""
    if type_ is Uint64 or type_ is Int64:
        if type(obj) is str and _DIGITS.fullmatch(obj):
            value = int(obj)
        elif type(obj) is int:
            value = obj
        else:
            raise msgspec.ValidationError(f"expected a decimal string, got {type(obj).__name__}")
        lo, hi = (0, _UINT64_MAX) if type_ is Uint64 else _INT64_RANGE
        if not lo <= value <= hi:
            raise msgspec.ValidationError(f"{value} is out of range for {type_.__name__}")
        return type_(value)
    raise NotImplementedError(f"cannot decode {type_!r}")


def schema_hook(type_: type) -> JSONObject:
    """msgspec ``schema_hook``: the JSON Schema of a :class:`Uint64` / :class:`Int64`."""
    if type_ is Uint64:
        return {"type": "string", "pattern": UINT64_PATTERN, "description": "uint64 as a decimal string"}
    if type_ is Int64:
        return {"type": "string", "pattern": INT64_PATTERN, "description": "int64 as a decimal string"}
    raise NotImplementedError(f"no JSON Schema for {type_!r}")


T = TypeVar("T")

#: Encoders of north answers (JSON text / msgpack): use these, or pass :func:`enc_hook`.
json_encoder: Final = msgspec.json.Encoder(enc_hook=enc_hook)
msgpack_encoder: Final = msgspec.msgpack.Encoder(enc_hook=enc_hook)


def json_decode(data: bytes | str, type_: type[T]) -> T:
    """Decode a north answer (e.g. the worker card) into ``type_``, 64-bit strings included."""
    return msgspec.json.decode(data, type=type_, dec_hook=dec_hook)
