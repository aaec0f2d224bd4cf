"""KvSessionRef bytes a client hands over (``kvSessionBytes``): validation and byte-exact splicing.

The decode engine must receive the prefill engine's ``KvSessionRef`` exactly as produced --
field order, unknown fields (a newer schema revision) and all. Re-serializing a parsed copy
would not guarantee that, so ``splice_kv_session`` keeps the raw bytes in ``KvOptions``'
unknown-field buffer, which betterproto2 writes out verbatim. ``parse_kv_session`` checks the
bytes first, because betterproto2's parser accepts malformed input silently.
"""

from __future__ import annotations

import copy
from typing import Any

import betterproto2

from sidecar.openengine import pb

__all__ = ["parse_kv_session", "splice_kv_session"]

#: Deepest message nesting accepted inside a KvSessionRef.
MAX_DEPTH = 32
_VARINT_TYPES = frozenset(
    {
        betterproto2.TYPE_INT32,
        betterproto2.TYPE_INT64,
        betterproto2.TYPE_UINT32,
        betterproto2.TYPE_UINT64,
        betterproto2.TYPE_SINT32,
        betterproto2.TYPE_SINT64,
        betterproto2.TYPE_BOOL,
        betterproto2.TYPE_ENUM,
    }
)
_FIXED64_TYPES = frozenset({betterproto2.TYPE_FIXED64, betterproto2.TYPE_SFIXED64, betterproto2.TYPE_DOUBLE})
_FIXED32_TYPES = frozenset({betterproto2.TYPE_FIXED32, betterproto2.TYPE_SFIXED32, betterproto2.TYPE_FLOAT})


def _read_varint(data: bytes, i: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if i >= len(data) or shift > 63:
            raise ValueError("truncated or overlong varint")
        b = data[i]
        i += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, i
        shift += 7


def _check_protobuf(cls: type[betterproto2.Message], data: bytes, depth: int) -> None:
    """Check ``data`` is well-formed protobuf whose known fields have their schema wire types
    (betterproto2's parser accepts garbage silently). Unknown fields: framing only."""
    if depth > MAX_DEPTH:
        raise ValueError("nested too deep")
    meta: Any = cls._betterproto  # type: ignore[arg-type]
    i, n = 0, len(data)
    while i < n:
        key, i = _read_varint(data, i)
        number, wire_type = key >> 3, key & 7
        if number == 0:
            raise ValueError("field number 0")
        start = i
        if wire_type == 0:
            _, i = _read_varint(data, i)
        elif wire_type == 1:
            i += 8
        elif wire_type == 5:
            i += 4
        elif wire_type == 2:
            length, i = _read_varint(data, i)
            start = i
            i += length
        else:
            raise ValueError(f"field {number}: unsupported wire type {wire_type}")
        if i > n:
            raise ValueError(f"field {number}: truncated")
        name = meta.field_name_by_number.get(number)
        if name is None:
            continue
        fmeta = meta.meta_by_field_name[name]
        proto_type = fmeta.proto_type
        if wire_type == 2:
            if proto_type in (betterproto2.TYPE_MESSAGE, betterproto2.TYPE_MAP):
                _check_protobuf(meta.cls_by_field[name], data[start:i], depth + 1)
            elif proto_type == betterproto2.TYPE_STRING:
                data[start:i].decode("utf-8")
            elif proto_type != betterproto2.TYPE_BYTES and not fmeta.repeated:
                raise ValueError(f"field {number} ({name}): wrong wire type")
        elif (
            (wire_type == 0 and proto_type not in _VARINT_TYPES)
            or (wire_type == 1 and proto_type not in _FIXED64_TYPES)
            or (wire_type == 5 and proto_type not in _FIXED32_TYPES)
        ):
            raise ValueError(f"field {number} ({name}): wrong wire type")


def parse_kv_session(raw: bytes) -> pb.KvSessionRef:
    """Check ``raw`` is a well-formed ``KvSessionRef`` (framing, known fields' wire types, UTF-8
    strings) and return its parsed form (for admission checks). Raises ``ValueError``."""
    _check_protobuf(pb.KvSessionRef, raw, 0)
    return pb.KvSessionRef.parse(raw)


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def splice_kv_session(request: pb.GenerateRequest, raw: bytes) -> pb.GenerateRequest:
    """A shallow copy of ``request`` whose ``kv.session`` is ``raw``, byte for byte.

    The bytes become field 1 (``session``) of ``KvOptions``, held in that message's unknown-field
    buffer: ``bytes()`` emits them untouched after the other ``KvOptions`` fields, as a single
    occurrence of the field (no reliance on protobuf's merging of repeated message fields).
    ``request`` itself is not modified.
    """
    out = copy.copy(request)
    kv = copy.copy(request.kv) if request.kv is not None else pb.KvOptions()
    kv.session = None
    kv._unknown_fields = b"\x0a" + _varint(len(raw)) + raw  # field 1, wire type 2 (length-delimited)
    out.kv = kv
    return out
