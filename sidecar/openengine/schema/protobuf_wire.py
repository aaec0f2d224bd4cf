"""The protobuf wire format, read strictly: exact field bytes and well-formedness checks.

- :func:`last_field_bytes` / :func:`nested_field_bytes`: a length-delimited field's exact
  bytes, used to relay the engine's ``KvSessionRef`` byte for byte (re-serializing a parsed
  message may reorder fields; a handoff is forwarded unchanged — docs/design/engine-facts.md).
- :func:`check_message` / :func:`parse_strict`: betterproto2's parser silently accepts
  truncated or malformed input, so bytes from outside (a client's ``kvSessionBytes``) are
  walked first: framing, the schema's wire type for every known field, UTF-8 strings,
  nesting depth. Unknown fields are checked for framing only (newer schema revisions).
"""

from __future__ import annotations

from typing import Any, TypeVar

import betterproto2

from sidecar.openengine.schema._betterproto2_internals import fields_by_number

M = TypeVar("M", bound=betterproto2.Message)

#: Deepest message nesting accepted by :func:`check_message`.
MAX_DEPTH = 32

_VARINT = frozenset(
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
_FIXED64 = frozenset({betterproto2.TYPE_FIXED64, betterproto2.TYPE_SFIXED64, betterproto2.TYPE_DOUBLE})
_FIXED32 = frozenset({betterproto2.TYPE_FIXED32, betterproto2.TYPE_SFIXED32, betterproto2.TYPE_FLOAT})


class WireError(ValueError):
    """The bytes are not a well-formed protobuf message (of the expected type)."""


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


def _fields(data: bytes) -> Any:
    """Yield ``(number, wire_type, start, end)`` for each field; ``start:end`` is the payload."""
    pos, end = 0, len(data)
    while pos < end:
        key, pos = _varint(data, pos)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise WireError("field number 0")
        start = pos
        if wire == 0:
            _, pos = _varint(data, pos)
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        elif wire == 2:
            length, start = _varint(data, pos)
            pos = start + length
        else:
            raise WireError(f"field {number}: unsupported wire type {wire}")
        if pos > end:
            raise WireError(f"field {number}: truncated")
        yield number, wire, start, pos


def without_field(data: bytes, number: int) -> tuple[bytes, list[bytes]]:
    """``data`` with the length-delimited occurrences of field ``number`` cut out, and their
    payloads in order (the rest byte for byte; cost: the fields' keys and lengths only, a
    large payload is skipped by its length). Raises :class:`WireError`."""
    rest: list[bytes] = []
    found: list[bytes] = []
    key_start = 0  # a field's key starts where the previous field ended
    for field, wire, start, end in _fields(data):
        if field == number and wire == 2:
            found.append(data[start:end])
        else:
            rest.append(data[key_start:end])
        key_start = end
    return b"".join(rest), found


def length_delimited(number: int, payload: bytes) -> bytes:
    """One length-delimited field (key, length, ``payload`` unchanged) in wire format."""
    return encode_varint(number << 3 | 2) + encode_varint(len(payload)) + payload


def encode_varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def last_field_bytes(data: bytes, number: int) -> bytes | None:
    """Bytes of the last length-delimited occurrence of field ``number`` (None if absent)."""
    found = None
    for field, wire, start, end in _fields(data):
        if field == number and wire == 2:
            found = data[start:end]
    return found


def nested_field_bytes(data: bytes, *path: int) -> bytes | None:
    """``last_field_bytes`` along a path of message fields (``4, 1``: prefill_ready.kv_session)."""
    current: bytes | None = data
    for number in path:
        if current is None:
            return None
        current = last_field_bytes(current, number)
    return current


def check_message(cls: type[betterproto2.Message], data: bytes, depth: int = 0) -> None:
    """Raise :class:`WireError` unless ``data`` is a well-formed ``cls`` (see module doc)."""
    if depth > MAX_DEPTH:
        raise WireError("nested too deep")
    known = fields_by_number(cls)
    for number, wire, start, end in _fields(data):
        field = known.get(number)
        if field is None:
            continue  # unknown: framing already checked
        name, kind = field.name, field.proto_type
        if wire == 2:
            if kind in (betterproto2.TYPE_MESSAGE, betterproto2.TYPE_MAP):
                check_message(field.cls, data[start:end], depth + 1)  # a map: its entry message
            elif kind == betterproto2.TYPE_STRING:
                try:
                    data[start:end].decode("utf-8")
                except UnicodeDecodeError:
                    raise WireError(f"field {number} ({name}): invalid utf-8") from None
            elif kind != betterproto2.TYPE_BYTES and not field.repeated:  # repeated scalars may be packed
                raise WireError(f"field {number} ({name}): wrong wire type")
        elif (
            (wire == 0 and kind not in _VARINT)
            or (wire == 1 and kind not in _FIXED64)
            or (wire == 5 and kind not in _FIXED32)
        ):
            raise WireError(f"field {number} ({name}): wrong wire type")


def parse_strict(cls: type[M], data: bytes) -> M:
    """``cls.parse(data)`` after :func:`check_message`; raises :class:`WireError` on bad input."""
    check_message(cls, data)
    try:
        return cls.parse(data)
    except Exception as err:  # betterproto2 raises assorted errors on input it cannot use
        raise WireError(f"not a {cls.__name__}: {type(err).__name__}: {err}") from None
