"""Decoding client frames (sidecar.north.codec.decode_frame): commands, and every validation error."""

from __future__ import annotations

import base64
import json
from typing import Any

import msgspec
import pytest

from sidecar.core.handoff import KvSessionRelease, abort_kv_session_bytes, splice_kv_session
from sidecar.north import codec, wire
from sidecar.north.codec import (
    CallCommand,
    CancelCommand,
    Encoding,
    FrameDecodeError,
    GenerateCommand,
    ProtocolError,
    decode_frame,
)
from sidecar.openengine import pb


def as_json(obj: Any) -> str:
    return json.dumps(obj)


def as_msgpack(obj: Any) -> bytes:
    return msgspec.msgpack.encode(obj)


BOTH = pytest.mark.parametrize("pack", [as_json, as_msgpack], ids=["json", "msgpack"])


@BOTH
def test_generate(pack: Any) -> None:
    frame = pack(
        {
            "type": "generate",
            "stream": 7,
            "request": {
                "model": "m",
                "prompt": "hi",
                "stopping": {"maxTokens": 4},
                "sampling": {"seed": "9"},
            },
            "metadata": {
                "openengine-routing-key": "abc",
                "traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01",
            },
        }
    )
    cmd = decode_frame(frame)
    assert isinstance(cmd, GenerateCommand)
    assert cmd.stream == 7
    assert cmd.encoding is (Encoding.JSON if pack is as_json else Encoding.MSGPACK)
    assert (
        cmd.request.prompt == "hi"
        and cmd.request.stopping is not None
        and cmd.request.stopping.max_tokens == 4
    )
    assert cmd.request.sampling is not None and cmd.request.sampling.seed == 9
    assert cmd.metadata["openengine-routing-key"] == "abc"
    assert cmd.kv_session_bytes is None
    assert splice_kv_session(cmd.request, cmd.kv_session_bytes) is cmd.request


def test_generate_msgpack_bin_bytes_field() -> None:
    frame = as_msgpack(
        {
            "type": "generate",
            "stream": "s",
            "request": {"media": [{"modality": "MODALITY_IMAGE", "rawBytes": b"\x89PNG"}]},
        }
    )
    cmd = decode_frame(frame)
    assert isinstance(cmd, GenerateCommand)
    assert cmd.request.media[0].raw_bytes == b"\x89PNG"


@BOTH
def test_metadata_and_params_may_be_null_or_absent(pack: Any) -> None:
    cmd = decode_frame(pack({"type": "generate", "stream": "a", "request": {}, "metadata": None}))
    assert isinstance(cmd, GenerateCommand) and cmd.metadata == {}
    call = decode_frame(pack({"type": "call", "call": 1, "method": "describe", "params": None}))
    assert isinstance(call, CallCommand) and call.params == {} and call.request is None


@BOTH
def test_cancel(pack: Any) -> None:
    cmd = decode_frame(pack({"type": "cancel", "stream": "abc"}))
    assert cmd == CancelCommand("abc", Encoding.JSON if pack is as_json else Encoding.MSGPACK)


@BOTH
@pytest.mark.parametrize(
    ("method", "params", "expected"),
    [
        ("describe", {}, None),
        ("load", {"includePerRank": True}, pb.GetLoadRequest(include_per_rank=True)),
        ("health", {"includeInferenceProbe": True}, pb.HealthRequest(include_inference_probe=True)),
        ("listLoras", {}, pb.ListLorasRequest()),
        (
            "loadLora",
            {"adapter": {"loraId": "3", "loraName": "a", "sourcePath": "/a"}},
            pb.LoadLoraRequest(adapter=pb.LoraAdapter(lora_id=3, lora_name="a", source_path="/a")),
        ),
        ("unloadLora", {"loraName": "a"}, pb.UnloadLoraRequest(lora_name="a")),
    ],
)
def test_call(pack: Any, method: str, params: dict[str, Any], expected: Any) -> None:
    cmd = decode_frame(pack({"type": "call", "call": "c1", "method": method, "params": params}))
    assert isinstance(cmd, CallCommand)
    assert (cmd.call, cmd.method, cmd.params) == ("c1", method, params)
    assert cmd.request == expected


#: A KvSessionRef with a field unknown to every schema revision (field 99) after its session id.
SESSION = bytes(pb.KvSessionRef(session_id="s-1")) + b"\x9a\x06\x05extra"


@BOTH
def test_release_kv_session_call_keeps_the_bytes(pack: Any) -> None:
    params = {"kvSessionBytes": base64.b64encode(SESSION).decode()}
    cmd = decode_frame(pack({"type": "call", "call": 7, "method": "releaseKvSession", "params": params}))
    assert isinstance(cmd, CallCommand) and isinstance(cmd.request, KvSessionRelease)
    assert cmd.request.raw == SESSION and cmd.request.session.session_id == "s-1"
    # what the engine gets: AbortRequest{kv_session = those bytes, unchanged}
    wire_abort = abort_kv_session_bytes(cmd.request.raw)
    assert pb.AbortRequest.parse(wire_abort).kv_session.session_id == "s-1"
    assert wire_abort.endswith(SESSION) and len(wire_abort) == len(SESSION) + 2


def test_abort_kv_session_bytes_length_prefix_past_one_byte() -> None:
    big = bytes(pb.KvSessionRef(session_id="x" * 300))
    parsed = pb.AbortRequest.parse(abort_kv_session_bytes(big))
    assert parsed.kv_session == pb.KvSessionRef(session_id="x" * 300)


@BOTH
@pytest.mark.parametrize(
    "params",
    [
        {},
        {"kvSessionBytes": ""},
        {"kvSessionBytes": "AAAA"},
        {"kvSessionBytes": 5},
        {"kvSessionBytes": "eA==", "x": 1},
    ],
)
def test_release_kv_session_call_refuses_anything_but_one_session(pack: Any, params: Any) -> None:
    with pytest.raises(ProtocolError) as info:
        decode_frame(pack({"type": "call", "call": "c9", "method": "releaseKvSession", "params": params}))
    assert info.value.call == "c9" and info.value.code == pb.ErrorCode.INVALID_ARGUMENT


@BOTH
@pytest.mark.parametrize(
    "frame",
    [
        ["generate"],
        "generate",
        {"type": "bogus", "stream": 1},
        {"stream": 1},
        {"type": "cancel"},
        {"type": "cancel", "stream": True},
        {"type": "cancel", "stream": 1.5},
        {"type": "cancel", "stream": -1},
        {"type": "cancel", "stream": 2**53},
        {"type": "cancel", "stream": ""},
        {"type": "cancel", "stream": "x" * (wire.MAX_ID_LENGTH + 1)},
        {"type": "cancel", "stream": None},
        {"type": "cancel", "stream": 1, "extra": 1},
        {"type": "generate", "stream": [1], "request": {}},
        {"type": "generate", "stream": {"a": 1}, "request": {"prompt": "x"}},
        {"type": "call", "call": True, "method": "describe"},
        {"type": 5},
    ],
)
def test_protocol_error_unattributed(pack: Any, frame: Any) -> None:
    with pytest.raises(ProtocolError) as info:
        decode_frame(pack(frame))
    err = info.value
    assert err.stream is None and err.call is None
    reply = codec.error_reply(err)
    assert isinstance(reply, wire.ProtocolErrorMessage) and reply.message


@BOTH
@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ({"request": None}, "request"),
        ({}, "missing required field `request`"),
        ({"request": []}, "request"),
        ({"request": {"prompt": 1}}, "request.prompt: expected a string"),
        ({"request": {"unknownField": 1}}, "unknown field 'unknownField'"),
        ({"request": {"prompt": "a", "tokenIds": {"ids": [1]}}}, "oneof"),
        ({"request": {}, "metadata": {"k": 1}}, "metadata"),
        ({"request": {}, "metadata": []}, "metadata"),
        ({"request": {}, "metadata": {"k": "v" * (wire.MAX_METADATA_VALUE_LENGTH + 1)}}, "longer than"),
        ({"request": {}, "metadata": {"k" * 9000: "v"}}, "exceeds"),
        ({"request": {}, "metadata": {f"k{i}": "v" for i in range(wire.MAX_METADATA_ENTRIES + 1)}}, "keys"),
        ({"request": {}, "metadata": {f"k{i}": "v" * 4000 for i in range(3)}}, "exceeds"),
        ({"request": {}, "kvSessionBytes": 5}, "kvSessionBytes"),
        ({"request": {}, "kvSessionBytes": "not base64!"}, "kvSessionBytes"),
        ({"request": {}, "kvSessionBytes": ""}, "empty"),
        ({"request": {}, "kvSessionBytes": base64.b64encode(b"\xff\xff").decode()}, "not a KvSessionRef"),
        ({"request": {}, "kvSessionBytes": base64.b64encode(b"\x0a\x05ab").decode()}, "truncated"),
        ({"request": {}, "kvSessionBytes": base64.b64encode(b"\x0b").decode()}, "wire type"),
        ({"request": {}, "kvSessionBytes": base64.b64encode(b"\x08\x01").decode()}, "wrong wire type"),
        ({"request": {}, "kvSessionBytes": base64.b64encode(b"\x0a\x02\xff\xfe").decode()}, "utf-8"),
        ({"request": {}, "kvSessionBytes": base64.b64encode(b"\x3a\x02\x10\x80").decode()}, "varint"),
        ({"request": {}, "unknown": 1}, "unknown field `unknown`"),
    ],
)
def test_protocol_error_attributed_to_stream(pack: Any, extra: dict[str, Any], needle: str) -> None:
    with pytest.raises(ProtocolError) as info:
        decode_frame(pack({"type": "generate", "stream": "s1", **extra}))
    err = info.value
    assert err.stream == "s1" and err.call is None
    assert err.code == pb.ErrorCode.INVALID_ARGUMENT
    assert needle in err.message
    reply = codec.error_reply(err)
    assert isinstance(reply, wire.End)
    assert reply.outcome == "rejected" and reply.stream == "s1"
    assert reply.error is not None and reply.error.code == "ERROR_CODE_INVALID_ARGUMENT"


def test_kv_session_bytes_too_large() -> None:
    big = b"\x0a" + b"\xff\xff\x3f" + b"x" * wire.MAX_KV_SESSION_BYTES
    with pytest.raises(ProtocolError, match="exceeds") as info:
        decode_frame(as_msgpack({"type": "generate", "stream": 1, "request": {}, "kvSessionBytes": big}))
    assert info.value.stream == 1


@BOTH
@pytest.mark.parametrize(
    ("frame", "code", "needle"),
    [
        (
            {"type": "call", "call": 4, "method": "launchMissiles"},
            pb.ErrorCode.UNSUPPORTED_FEATURE,
            "unknown method",
        ),
        (
            {"type": "call", "call": 4, "method": "describe", "params": {"x": 1}},
            pb.ErrorCode.INVALID_ARGUMENT,
            "no params",
        ),
        (
            {"type": "call", "call": 4, "method": "loadLora", "params": {"x": 1}},
            pb.ErrorCode.INVALID_ARGUMENT,
            "unknown",
        ),
        (
            {"type": "call", "call": 4, "method": "load", "params": []},
            pb.ErrorCode.INVALID_ARGUMENT,
            "params",
        ),
        ({"type": "call", "call": 4, "method": 5}, pb.ErrorCode.INVALID_ARGUMENT, "method"),
        ({"type": "call", "call": 4}, pb.ErrorCode.INVALID_ARGUMENT, "method"),
    ],
)
def test_protocol_error_attributed_to_call(pack: Any, frame: Any, code: pb.ErrorCode, needle: str) -> None:
    with pytest.raises(ProtocolError) as info:
        decode_frame(pack(frame))
    err = info.value
    assert err.call == 4 and err.stream is None and err.code == code
    assert needle in err.message
    reply = codec.error_reply(err)
    assert isinstance(reply, wire.Result) and not reply.ok and reply.error is not None


@pytest.mark.parametrize(
    "frame",
    [
        "",
        "{",
        '{"type":"cancel","stream":1}x',
        '{"type":"cancel","stream":"\\ud800"}',
        b"",
        b"\xc1",
        msgspec.msgpack.encode({"type": "cancel", "stream": 1}) + b"\x00",
        b"\x82\xa4type\xa6cancel\xa6stream\xa2\xff\xfe",  # invalid UTF-8 in a msgpack str
    ],
)
def test_undecodable(frame: str | bytes) -> None:
    with pytest.raises(FrameDecodeError):
        decode_frame(frame)


def deep_generate(encoding: str, depth: int) -> str | bytes:
    """A ``generate`` whose ``request.extra`` nests ``depth`` arrays."""
    if encoding == "json":
        return '{"type":"generate","stream":1,"request":{"extra":' + "[" * depth + "]" * depth + "}}"
    return b"\x83\xa4type\xa8generate\xa6stream\x01\xa7request\x81\xa5extra" + b"\x91" * depth + b"\xc0"


@pytest.mark.parametrize("encoding", ["json", "msgpack"])
@pytest.mark.parametrize("depth", [1_000, 100_000])
def test_nesting_past_the_decoder_is_a_protocol_error(encoding: str, depth: int) -> None:
    """Well-formed but deeper than the decoder recurses: a typed ``protocol_error`` (the
    connection goes on), not a close 1007 (issue 15)."""
    with pytest.raises(ProtocolError) as info:
        decode_frame(deep_generate(encoding, depth))
    assert "nested too deep" in info.value.message
    assert isinstance(codec.error_reply(info.value), wire.ProtocolErrorMessage)


@pytest.mark.parametrize("pack", [as_json, as_msgpack])
@pytest.mark.parametrize(
    "where",
    [
        lambda v: {"stopping": {"maxTokens": v}},
        lambda v: {"sampling": {"seed": v}},
        lambda v: {"tokenIds": {"ids": [1, v]}},
    ],
)
@pytest.mark.parametrize("digits", [21, 4_301, 100_000])
def test_integer_strings_longer_than_20_digits_are_refused(pack: Any, where: Any, digits: int) -> None:
    """A decimal-string integer of any length gets a typed ``end rejected`` (Python refuses to
    convert more than 4,300 digits: that ValueError used to end the connection, issue 15)."""
    request = {"model": "m", **where("9" * digits)}
    with pytest.raises(ProtocolError) as info:
        decode_frame(pack({"type": "generate", "stream": 7, "request": request}))
    assert info.value.stream == 7 and "at most 20 digits" in info.value.message
    assert len(info.value.message) < 400


def test_twenty_digits_still_decode() -> None:
    cmd = decode_frame(
        as_json({"type": "generate", "stream": 1, "request": {"sampling": {"seed": "18446744073709551615"}}})
    )
    assert isinstance(cmd, GenerateCommand) and cmd.request.sampling is not None
    assert cmd.request.sampling.seed == 2**64 - 1


@pytest.mark.parametrize("pack", [as_json, as_msgpack])
def test_error_messages_never_carry_unbounded_client_input(pack: Any) -> None:
    """Unknown ``type`` values, unknown methods, model names: cut in the answer (issue 15)."""
    huge = "x\n" * 500_000
    frames = [
        {"type": huge, "stream": 1},
        {"type": "call", "call": 1, "method": huge},
        {"type": "generate", "stream": 1, "request": {"prompt": "x", huge: 1}},
        {"type": "generate", "stream": 1, "request": {"prompt": "x", "stopping": {"maxTokens": huge}}},
        {"type": "generate", "stream": huge, "request": {}},
    ]
    for frame in frames:
        with pytest.raises(ProtocolError) as info:
            decode_frame(pack(frame))
        message = info.value.message
        assert len(message) <= codec.MAX_ERROR_MESSAGE + 20, len(message)
        assert "\n" not in message
        encoded = codec.encode(codec.error_reply(info.value), codec.Encoding.JSON)
        assert len(encoded) < 2 * codec.MAX_ERROR_MESSAGE


def test_same_id_types_are_distinct() -> None:
    a = decode_frame(as_json({"type": "cancel", "stream": 1}))
    b = decode_frame(as_json({"type": "cancel", "stream": "1"}))
    assert isinstance(a, CancelCommand) and isinstance(b, CancelCommand)
    assert a.stream == 1 and b.stream == "1" and a.stream != b.stream


def test_limits_accept_boundaries() -> None:
    cmd = decode_frame(
        as_json(
            {
                "type": "generate",
                "stream": "x" * wire.MAX_ID_LENGTH,
                "request": {},
                "metadata": {f"k{i}": "v" for i in range(wire.MAX_METADATA_ENTRIES)},
            }
        )
    )
    assert isinstance(cmd, GenerateCommand)
    # key syntax and values are admission's (sidecar.core.metadata): passed through here
    cmd = decode_frame(
        as_json({"type": "generate", "stream": 1, "request": {}, "metadata": {"X-Upper": "caf\u00e9"}})
    )
    assert isinstance(cmd, GenerateCommand) and cmd.metadata == {"X-Upper": "caf\u00e9"}
    assert isinstance(decode_frame(as_json({"type": "cancel", "stream": wire.MAX_ID_INT})), CancelCommand)
    assert isinstance(decode_frame(as_json({"type": "cancel", "stream": 0})), CancelCommand)
