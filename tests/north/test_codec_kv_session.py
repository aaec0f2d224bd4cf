"""kvSessionBytes: the client's KvSessionRef bytes reach the engine byte for byte (issue 5)."""

from __future__ import annotations

import base64
import json

import msgspec
import pytest

from sidecar.core.handoff import splice_kv_session
from sidecar.north import codec, wire
from sidecar.north.codec import Encoding, GenerateCommand, ProtocolError, decode_frame
from sidecar.openengine import pb
from sidecar.openengine.schema._betterproto2_internals import unknown_fields


def varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def ld(number: int, payload: bytes) -> bytes:
    """A length-delimited field."""
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def fields(data: bytes) -> list[tuple[int, int, bytes]]:
    """Top-level (number, wire type, raw value) of a protobuf message (test-side walker)."""
    out, i = [], 0
    while i < len(data):
        key, shift = 0, 0
        while True:
            b = data[i]
            i += 1
            key |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                break
        number, wt = key >> 3, key & 7
        start = i
        if wt == 0:
            while data[i] & 0x80:
                i += 1
            i += 1
            out.append((number, wt, data[start:i]))
        elif wt == 2:
            length, shift = 0, 0
            while True:
                b = data[i]
                i += 1
                length |= (b & 0x7F) << shift
                shift += 7
                if not b & 0x80:
                    break
            out.append((number, wt, data[i : i + length]))
            i += length
        else:
            raise AssertionError(f"unexpected wire type {wt}")
    return out


# A KvSessionRef as a newer engine might send it: fields out of canonical order, an unknown field
# (number 100) in the middle, an unknown field inside a nested KvEndpoint, and attributes.
ENDPOINT = ld(1, b"10.0.0.1") + bytes([0x10]) + varint(7000) + ld(50, b"endpoint-extra")
RAW_SESSION = (
    bytes([0x20, 0x01])  # dp_rank = 1 (field 4) before field 1
    + ld(100, b"from-the-future")
    + ld(1, b"sess-42")
    + ld(3, ENDPOINT)
    + ld(6, b"vllm.kv_transfer_params.v1")
    + ld(5, bytes(pb.Struct.from_dict({"remote_block_ids": [1, 2, 3], "remote_host": "10.0.0.1"})))
    + ld(2, b"nixl")
)


def kv_field_1(request_bytes: bytes) -> bytes:
    kv = [v for n, _, v in fields(request_bytes) if n == 8]
    assert len(kv) == 1, "exactly one KvOptions occurrence"
    sessions = [v for n, _, v in fields(kv[0]) if n == 1]
    assert len(sessions) == 1, "exactly one session occurrence"
    return sessions[0]


def test_raw_session_is_not_canonical() -> None:
    # The point of splicing: re-serializing the parsed message would change the bytes.
    assert bytes(pb.KvSessionRef.parse(RAW_SESSION)) != RAW_SESSION


@pytest.mark.parametrize("form", ["json", "msgpack-bin", "msgpack-base64"])
def test_bytes_survive_unchanged(form: str) -> None:
    msg = {
        "type": "generate",
        "stream": 1,
        "request": {
            "model": "m",
            "tokenIds": {"ids": [1, 2]},
            "kv": {"bypassPrefixCache": True, "cacheSalt": "x"},
        },
        "kvSessionBytes": base64.b64encode(RAW_SESSION).decode(),
    }
    if form == "json":
        frame: str | bytes = json.dumps(msg)
    else:
        if form == "msgpack-bin":
            msg["kvSessionBytes"] = RAW_SESSION
        frame = msgspec.msgpack.encode(msg)
    cmd = decode_frame(frame)
    assert isinstance(cmd, GenerateCommand)
    assert cmd.kv_session_bytes == RAW_SESSION
    # parsed view for admission checks
    assert cmd.request.kv is not None and cmd.request.kv.session is not None
    session = cmd.request.kv.session
    assert (session.session_id, session.dp_rank, session.transfer_backend) == ("sess-42", 1, "nixl")
    assert session.handoff_profile == "vllm.kv_transfer_params.v1"

    cmd.request.request_id = "filled-by-sidecar"  # later edits are reflected
    out = bytes(splice_kv_session(cmd.request, cmd.kv_session_bytes))
    assert kv_field_1(out) == RAW_SESSION
    parsed = pb.GenerateRequest.parse(out)
    assert parsed.request_id == "filled-by-sidecar"
    assert parsed.kv is not None and parsed.kv.bypass_prefix_cache is True and parsed.kv.cache_salt == "x"
    assert parsed.kv.session is not None
    assert parsed.kv.session.session_id == "sess-42"
    assert unknown_fields(parsed.kv.session) == ld(100, b"from-the-future")
    assert unknown_fields(parsed.kv.session.endpoints[0]) == ld(50, b"endpoint-extra")
    assert parsed.token_ids is not None and parsed.token_ids.ids == [1, 2]
    # the command itself is untouched
    assert cmd.request.kv.session is session


def test_request_without_kv_options() -> None:
    cmd = decode_frame(
        json.dumps(
            {
                "type": "generate",
                "stream": 1,
                "request": {},
                "kvSessionBytes": base64.b64encode(RAW_SESSION).decode(),
            }
        )
    )
    assert isinstance(cmd, GenerateCommand)
    req = splice_kv_session(cmd.request, cmd.kv_session_bytes)
    assert req is not cmd.request
    assert kv_field_1(bytes(req)) == RAW_SESSION


def test_both_session_forms_rejected() -> None:
    frame = json.dumps(
        {
            "type": "generate",
            "stream": "s",
            "request": {"kv": {"session": {"sessionId": "a"}}},
            "kvSessionBytes": base64.b64encode(RAW_SESSION).decode(),
        }
    )
    with pytest.raises(ProtocolError, match="not both") as info:
        decode_frame(frame)
    assert info.value.stream == "s"


def test_session_in_request_json_is_used_as_is() -> None:
    cmd = decode_frame(
        json.dumps({"type": "generate", "stream": 1, "request": {"kv": {"session": {"sessionId": "a"}}}})
    )
    assert isinstance(cmd, GenerateCommand) and cmd.kv_session_bytes is None
    assert splice_kv_session(cmd.request, cmd.kv_session_bytes) is cmd.request


@pytest.mark.parametrize("encoding", list(Encoding))
def test_prefill_ready_event_carries_session_bytes(encoding: Encoding) -> None:
    # Engine -> sidecar: betterproto2 keeps unknown fields through parse -> bytes.
    canonical = bytes(pb.KvSessionRef(session_id="sess-42", dp_rank=1)) + ld(100, b"from-the-future")
    session = pb.KvSessionRef.parse(canonical)
    resp = pb.GenerateResponse(
        request_id="r", prefill_ready=pb.PrefillReady(kv_session=session), usage=pb.Usage()
    )
    frame = codec.encode_event(3, resp, encoding)
    assert isinstance(frame, str if encoding is Encoding.JSON else bytes)
    msg = codec.decode_server_frame(frame)
    assert isinstance(msg, wire.Event)
    assert msg.kv_session_bytes == canonical
    assert msg.response.prefill_ready is not None
    assert msg.response.prefill_ready.kv_session == {"sessionId": "sess-42", "dpRank": 1}
    if encoding is Encoding.JSON:
        assert json.loads(frame)["kvSessionBytes"] == base64.b64encode(canonical).decode()
    else:
        assert msgspec.msgpack.decode(frame)["kvSessionBytes"] == canonical  # msgpack bin
    # When the server has the engine's exact bytes, they are used verbatim.
    exact = codec.event_message(3, resp, kv_session_bytes=RAW_SESSION)
    assert exact.kv_session_bytes == RAW_SESSION


def test_decode_handoff_round_trip() -> None:
    """prefill event -> client -> decode generate -> engine bytes: the session bytes are unchanged."""
    resp = pb.GenerateResponse(
        request_id="p", prefill_ready=pb.PrefillReady(kv_session=pb.KvSessionRef.parse(RAW_SESSION))
    )
    event = codec.decode_server_frame(
        codec.encode(codec.event_message(1, resp, kv_session_bytes=RAW_SESSION), Encoding.JSON)
    )
    assert isinstance(event, wire.Event) and event.kv_session_bytes == RAW_SESSION
    gen = wire.Generate(stream=2, request={"prompt": "x"}, kv_session_bytes=event.kv_session_bytes)
    for encoding in Encoding:
        cmd = decode_frame(codec.encode(gen, encoding))
        assert isinstance(cmd, GenerateCommand)
        assert kv_field_1(bytes(splice_kv_session(cmd.request, cmd.kv_session_bytes))) == RAW_SESSION
