"""Exact bytes of nested fields (the prefillReady KvSessionRef relay)."""

from __future__ import annotations

import pytest

from sidecar.openengine import pb
from sidecar.openengine.schema.decode import HandedOver, decode_generate_response
from sidecar.openengine.schema.protobuf_wire import WireError, last_field_bytes, nested_field_bytes

# dp_rank=1 before session_id (out of field order), plus unknown field 99: re-serializing differs
RAW_SESSION = b"\x20\x01" + b"\x0a\x01a" + b"\x9a\x06\x02hi"


def prefill_ready_bytes(raw: bytes) -> bytes:
    inner = b"\x0a" + bytes([len(raw)]) + raw  # PrefillReady.kv_session = 1
    return b"\x0a\x01x" + b"\x22" + bytes([len(inner)]) + inner  # request_id, prefill_ready = 4


def test_decoding_keeps_engine_session_bytes() -> None:
    handed = decode_generate_response(prefill_ready_bytes(RAW_SESSION))
    assert isinstance(handed, HandedOver) and handed.raw == RAW_SESSION
    assert handed.message.prefill_ready.kv_session.session_id == "a"
    assert bytes(handed.message.prefill_ready.kv_session) != RAW_SESSION  # why the raw bytes are kept


def test_other_events_are_plain_messages() -> None:
    data = bytes(pb.GenerateResponse(request_id="x", token=pb.TokenOutput(output_index=0)))
    assert type(decode_generate_response(data)) is pb.GenerateResponse


def test_last_occurrence_wins_and_scalars_are_skipped() -> None:
    data = b"\x08\x96\x01" + b"\x12\x01a" + b"\x1d\x00\x00\x00\x00" + b"\x12\x02bc" + b"\x19" + b"\x00" * 8
    assert last_field_bytes(data, 2) == b"bc"
    assert last_field_bytes(data, 7) is None
    assert nested_field_bytes(prefill_ready_bytes(RAW_SESSION), 4, 1) == RAW_SESSION
    assert nested_field_bytes(b"", 4, 1) is None


@pytest.mark.parametrize("bad", [b"\x12\x05ab", b"\x08", b"\x0b", b"\x08" + b"\xff" * 11])
def test_malformed_bytes_raise(bad: bytes) -> None:
    with pytest.raises(WireError):
        last_field_bytes(bad, 2)
