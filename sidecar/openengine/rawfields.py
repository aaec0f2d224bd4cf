"""Reading a length-delimited field's exact bytes out of a serialized message.

Used to relay the engine's ``KvSessionRef`` byte for byte: re-serializing a parsed message
may reorder fields, and a handoff is forwarded unchanged (ENGINE-FACTS.md, handoff profiles).
"""

from __future__ import annotations


class WireError(ValueError):
    """The bytes are not a well-formed protobuf message."""


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise WireError("truncated or overlong varint")
        b = data[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7


def last_field_bytes(data: bytes, number: int) -> bytes | None:
    """Bytes of the last length-delimited occurrence of field ``number`` (None if absent)."""
    pos, found, end = 0, None, len(data)
    while pos < end:
        key, pos = _varint(data, pos)
        field, wire = key >> 3, key & 7
        if wire == 0:
            _, pos = _varint(data, pos)
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        elif wire == 2:
            length, pos = _varint(data, pos)
            if pos + length > end:
                raise WireError("length-delimited field runs past the end")
            if field == number:
                found = data[pos : pos + length]
            pos += length
        else:
            raise WireError(f"unsupported wire type {wire}")
    if pos != end:
        raise WireError("truncated field")
    return found


def nested_field_bytes(data: bytes, *path: int) -> bytes | None:
    """``last_field_bytes`` followed along a path of message fields (``4, 1``: prefill_ready.kv_session)."""
    current: bytes | None = data
    for number in path:
        if current is None:
            return None
        current = last_field_bytes(current, number)
    return current
