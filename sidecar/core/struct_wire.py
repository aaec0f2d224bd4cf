"""``google.protobuf.Struct`` bytes to their proto3 JSON form, without building messages.

betterproto2 parses a ``Struct`` into one dataclass per ``Value`` and then converts it with
``to_dict``: ~1 µs per byte. :func:`struct_to_dict` walks the wire format directly and
builds the same ``dict`` (numbers as ``float``, ``null`` as ``None``) several times faster.
Used for ``GetLoad.attributes`` (sidecar/core/load.py). Raises :class:`StructWireError`.
"""

from __future__ import annotations

import struct

from sidecar.json_types import JSONObject, JSONValue

__all__ = ["StructWireError", "struct_to_dict"]

_DOUBLE = struct.Struct("<d")
#: Deepest Struct/ListValue nesting accepted (protobuf's own default recursion limit is 100).
MAX_DEPTH = 64


class StructWireError(ValueError):
    """The bytes are not a well-formed ``google.protobuf.Struct``."""


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    b = data[pos]
    if b < 0x80:
        return b, pos + 1
    result = b & 0x7F
    shift = 7
    pos += 1
    while True:
        if shift > 63:
            raise StructWireError("overlong varint")
        b = data[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos
        shift += 7


def _skip(data: bytes, pos: int, wire: int) -> int:
    if wire == 0:
        return _varint(data, pos)[1]
    if wire == 1:
        return pos + 8
    if wire == 5:
        return pos + 4
    if wire == 2:
        length, pos = _varint(data, pos)
        return pos + length
    raise StructWireError(f"unsupported wire type {wire}")


def _value(data: bytes, pos: int, end: int, depth: int) -> JSONValue:
    """A ``Value`` message in ``data[pos:end]`` (the last kind set wins, as in protobuf)."""
    out: JSONValue = None
    while pos < end:
        key, pos = _varint(data, pos)
        number, wire = key >> 3, key & 7
        if number == 2 and wire == 1:  # number_value
            out = _DOUBLE.unpack_from(data, pos)[0]
            pos += 8
        elif wire == 2 and number in (3, 5, 6):
            length, pos = _varint(data, pos)
            stop = pos + length
            if stop > end:
                raise StructWireError("truncated value")
            if number == 3:  # string_value
                out = data[pos:stop].decode("utf-8")
            elif number == 5:  # struct_value
                out = _struct(data, pos, stop, depth + 1)
            else:  # list_value
                out = _list(data, pos, stop, depth + 1)
            pos = stop
        elif number in (1, 4) and wire == 0:  # null_value, bool_value
            flag, pos = _varint(data, pos)
            out = None if number == 1 else bool(flag)
        else:
            pos = _skip(data, pos, wire)
    if pos != end:
        raise StructWireError("truncated value")
    return out


def _struct(data: bytes, pos: int, end: int, depth: int) -> JSONObject:
    if depth > MAX_DEPTH:
        raise StructWireError("nested too deep")
    out: JSONObject = {}
    while pos < end:
        key, pos = _varint(data, pos)
        if key != 0x0A:  # not field 1 (fields), length-delimited: unknown, skip
            pos = _skip(data, pos, key & 7)
            continue
        length, pos = _varint(data, pos)
        stop = pos + length
        if stop > end:
            raise StructWireError("truncated entry")
        name, value = "", None
        while pos < stop:
            ekey, pos = _varint(data, pos)
            if ekey == 0x0A:  # key
                n, pos = _varint(data, pos)
                name = data[pos : pos + n].decode("utf-8")
                pos += n
            elif ekey == 0x12:  # value
                n, pos = _varint(data, pos)
                if pos + n > stop:
                    raise StructWireError("truncated entry value")
                value = _value(data, pos, pos + n, depth)
                pos += n
            else:
                pos = _skip(data, pos, ekey & 7)
        if pos != stop:
            raise StructWireError("truncated entry")
        out[name] = value
    if pos != end:
        raise StructWireError("truncated struct")
    return out


def _list(data: bytes, pos: int, end: int, depth: int) -> list[JSONValue]:
    if depth > MAX_DEPTH:
        raise StructWireError("nested too deep")
    out: list[JSONValue] = []
    while pos < end:
        key, pos = _varint(data, pos)
        if key != 0x0A:
            pos = _skip(data, pos, key & 7)
            continue
        n, pos = _varint(data, pos)
        if pos + n > end:
            raise StructWireError("truncated list")
        out.append(_value(data, pos, pos + n, depth))
        pos += n
    if pos != end:
        raise StructWireError("truncated list")
    return out


def struct_to_dict(data: bytes) -> JSONObject:
    """The proto3 JSON form of serialized ``Struct`` bytes (as ``pb.Struct.parse(data).to_dict()``)."""
    try:
        return _struct(data, 0, len(data), 0)
    except (IndexError, UnicodeDecodeError, struct.error) as err:
        raise StructWireError(f"malformed Struct: {type(err).__name__}: {err}") from None
