"""Encoding sidecar -> client messages: exact proto3 JSON shapes, msgpack parity, round trips."""

from __future__ import annotations

import json
import math
from typing import Any

import msgspec
import pytest

from sidecar.north import codec, wire
from sidecar.north.codec import Encoding, EventEncoder
from sidecar.north.pbjson import message_to_json
from sidecar.openengine import pb

TI = pb.TokenInfo

RESPONSES: dict[str, pb.GenerateResponse] = {
    "token": pb.GenerateResponse(
        request_id="r1", token=pb.TokenOutput(output_index=0, tokens=[TI(token_id=42, token="Hi")], text="Hi")
    ),
    "token-no-request-id": pb.GenerateResponse(
        token=pb.TokenOutput(output_index=1, tokens=[TI(token_id=0)], text="")
    ),
    "token-multi-logprobs": pb.GenerateResponse(
        request_id="r1",
        token=pb.TokenOutput(
            output_index=2,
            tokens=[
                TI(
                    token_id=5,
                    token="a",
                    logprob=-0.25,
                    rank=1,
                    candidates=[
                        pb.LogProb(token_id=5, logprob=-0.25, token="a", rank=1),
                        pb.LogProb(token_id=6, logprob=-math.inf, token="b", rank=0),
                        pb.LogProb(token_id=7, logprob=0.0, token="c"),
                    ],
                ),
                TI(token_id=9, token="b", logprob=0.0, rank=0),
                TI(token_id=10, token="c", logprob=math.nan),
            ],
            text="abc",
        ),
    ),
    "token-empty": pb.GenerateResponse(request_id="r1", token=pb.TokenOutput(output_index=0)),
    "token-with-usage": pb.GenerateResponse(
        request_id="r1",
        token=pb.TokenOutput(output_index=0, tokens=[TI(token_id=1, token="x")], text="x"),
        usage=pb.Usage(prompt_tokens=3, completion_tokens=1, total_tokens=4, cached_prompt_tokens=0),
    ),
    "prompt": pb.GenerateResponse(
        request_id="r1",
        prompt=pb.PromptOutput(tokens=[TI(token_id=1, token="<s>"), TI(token_id=2, logprob=-1.5)]),
    ),
    "prompt-empty": pb.GenerateResponse(request_id="r1", prompt=pb.PromptOutput()),
    "prefill-ready": pb.GenerateResponse(
        request_id="r1",
        prefill_ready=pb.PrefillReady(
            kv_session=pb.KvSessionRef(
                session_id="s",
                bootstrap=pb.KvBootstrap(room_id=2**63 + 1),
                attributes_struct=pb.Struct.from_dict({"n": 1}),
            )
        ),
        usage=pb.Usage(prompt_tokens=5, total_tokens=5),
    ),
    "finished-stop-token": pb.GenerateResponse(
        request_id="r1",
        finished=pb.GenerationFinished(
            output_index=0, reason=pb.FinishReason.STOP, stop_match=pb.StopMatch(stop_token_id=0)
        ),
        usage=pb.Usage(prompt_tokens=1, completion_tokens=2, total_tokens=3, reasoning_tokens=0),
    ),
    "finished-stop-text": pb.GenerateResponse(
        request_id="r1",
        finished=pb.GenerationFinished(
            output_index=1, reason=pb.FinishReason.STOP, stop_match=pb.StopMatch(stop_text="\n")
        ),
    ),
    "finished-eos": pb.GenerateResponse(
        request_id="r1",
        finished=pb.GenerationFinished(
            output_index=0, reason=pb.FinishReason.STOP, stop_match=pb.StopMatch(eos_token_id=2)
        ),
    ),
    "finished-length": pb.GenerateResponse(
        request_id="r1",
        finished=pb.GenerationFinished(output_index=0, reason=pb.FinishReason.LENGTH, message="max"),
    ),
    "finished-unknown-reason": pb.GenerateResponse(finished=pb.GenerationFinished(reason=pb.FinishReason(9))),
    "error": pb.GenerateResponse(
        request_id="r1",
        error=pb.EngineError(code=pb.ErrorCode.KV_TRANSFER_FAILED, message="boom", retryable=True),
    ),
    "error-unknown-code": pb.GenerateResponse(error=pb.EngineError(code=pb.ErrorCode(77))),
    "empty": pb.GenerateResponse(),
}


def expected_json(resp: pb.GenerateResponse) -> dict[str, Any]:
    """The reference: the generic proto3 JSON mapping (itself checked against betterproto2's to_dict)."""
    return message_to_json(resp)


@pytest.mark.parametrize("name", list(RESPONSES))
def test_event_json_matches_proto3_mapping(name: str) -> None:
    resp = RESPONSES[name]
    frame = codec.encode_event("s", resp, Encoding.JSON)
    assert isinstance(frame, str)
    obj = json.loads(frame)
    assert obj["type"] == "event" and obj["stream"] == "s"
    assert obj["response"] == expected_json(resp)
    # betterproto2's own mapping agrees (except kvSession attributes, identical too)
    assert obj["response"] == resp.to_dict()
    assert ("kvSessionBytes" in obj) == (name == "prefill-ready")


@pytest.mark.parametrize("name", list(RESPONSES))
def test_event_msgpack_has_same_shape(name: str) -> None:
    resp = RESPONSES[name]
    frame = codec.encode_event(9, resp, Encoding.MSGPACK)
    assert isinstance(frame, bytes)
    obj = msgspec.msgpack.decode(frame)
    assert obj["response"] == expected_json(resp) or _nan_equal(obj["response"], expected_json(resp))


def _nan_equal(a: Any, b: Any) -> bool:
    return msgspec.json.encode(a, order="sorted") == msgspec.json.encode(b, order="sorted")


@pytest.mark.parametrize("encoding", list(Encoding))
@pytest.mark.parametrize("name", list(RESPONSES))
def test_event_encoder_identical_to_generic(encoding: Encoding, name: str) -> None:
    enc = EventEncoder("stream-1", encoding)
    resp = RESPONSES[name]
    for _ in range(2):  # second call uses the cached envelope
        fast = enc.encode(resp)
        slow = codec.encode_event("stream-1", resp, encoding)
        if encoding is Encoding.JSON:
            assert json.loads(fast) == json.loads(slow)
        else:
            assert _nan_equal(msgspec.msgpack.decode(fast), msgspec.msgpack.decode(slow))


def test_event_encoder_follows_request_id_change() -> None:
    enc = EventEncoder(1, Encoding.JSON)
    a = json.loads(enc.encode(RESPONSES["token"]))
    b = json.loads(enc.encode(RESPONSES["token-no-request-id"]))
    assert a["response"]["requestId"] == "r1" and "requestId" not in b["response"]


def test_exact_token_frame() -> None:
    frame = EventEncoder(7, Encoding.JSON).encode(RESPONSES["token"])
    assert frame == (
        '{"type":"event","stream":7,"response":{"requestId":"r1","token":'
        '{"outputIndex":0,"tokens":[{"tokenId":42,"token":"Hi"}],"text":"Hi"}}}'
    )


def test_proto3_details_in_events() -> None:
    obj = json.loads(codec.encode_event(1, RESPONSES["token-multi-logprobs"], Encoding.JSON))
    tokens = obj["response"]["token"]["tokens"]
    assert tokens[0]["candidates"][1] == {"tokenId": 6, "logprob": "-Infinity", "token": "b", "rank": 0}
    assert tokens[0]["candidates"][2] == {"tokenId": 7, "token": "c"}  # non-optional logprob 0.0 omitted
    assert tokens[1] == {"tokenId": 9, "token": "b", "logprob": 0.0, "rank": 0}  # optional zero kept
    assert tokens[2]["logprob"] == "NaN"
    fin = json.loads(codec.encode_event(1, RESPONSES["finished-stop-token"], Encoding.JSON))["response"]
    assert fin["finished"] == {
        "outputIndex": 0,
        "reason": "FINISH_REASON_STOP",
        "stopMatch": {"stopTokenId": 0},
    }
    assert fin["usage"] == {"promptTokens": 1, "completionTokens": 2, "totalTokens": 3, "reasoningTokens": 0}
    pre = json.loads(codec.encode_event(1, RESPONSES["prefill-ready"], Encoding.JSON))["response"]
    assert pre["prefillReady"]["kvSession"]["bootstrap"]["roomId"] == str(2**63 + 1)
    err = json.loads(codec.encode_event(1, RESPONSES["error"], Encoding.JSON))["response"]["error"]
    assert err == {"code": "ERROR_CODE_KV_TRANSFER_FAILED", "message": "boom", "retryable": True}
    assert json.loads(codec.encode_event(1, RESPONSES["error-unknown-code"], Encoding.JSON))["response"] == {
        "error": {"code": 77}
    }
    assert json.loads(codec.encode_event(1, RESPONSES["empty"], Encoding.JSON))["response"] == {}


@pytest.mark.parametrize("encoding", list(Encoding))
@pytest.mark.parametrize("name", list(RESPONSES))
def test_client_decodes_events(encoding: Encoding, name: str) -> None:
    resp = RESPONSES[name]
    msg = codec.decode_server_frame(codec.encode_event(5, resp, encoding))
    assert isinstance(msg, wire.Event) and msg.stream == 5
    r = msg.response
    assert r.request_id == resp.request_id
    if resp.token is not None:
        assert r.kind == "token" and r.token is not None and r.text == resp.token.text
        for got, want in zip(r.token.tokens, resp.token.tokens, strict=True):
            assert got.token_id == want.token_id
            if want.logprob is not None and math.isnan(want.logprob):
                assert got.logprob is not None and math.isnan(got.logprob)
            else:
                assert got.logprob == want.logprob  # "-Infinity" etc. decode back to floats
    # the typed view converts back to the pb message
    assert pb.GenerateResponse.from_dict(msgspec.to_builtins(r)).request_id == resp.request_id


def test_response_kinds() -> None:
    kinds = {
        name: codec.response_to_wire(resp).kind
        for name, resp in RESPONSES.items()
        if name in ("token", "prompt", "prefill-ready", "finished-eos", "error", "empty")
    }
    assert kinds == {
        "token": "token",
        "prompt": "prompt",
        "prefill-ready": "prefillReady",
        "finished-eos": "finished",
        "error": "error",
        "empty": None,
    }


@pytest.mark.parametrize("encoding", list(Encoding))
def test_end_result_protocol_error(encoding: Encoding) -> None:
    def rt(msg: Any) -> Any:
        frame = codec.encode(msg, encoding)
        assert isinstance(frame, str if encoding is Encoding.JSON else bytes)
        return frame, codec.decode_server_frame(frame)

    frame, end = rt(codec.end_message("s", "completed"))
    assert end == wire.End(stream="s", outcome="completed", error=None)
    if encoding is Encoding.JSON:
        assert json.loads(frame) == {"type": "end", "stream": "s", "outcome": "completed", "error": None}
    err = codec.error_body(pb.ErrorCode.DRAINING, "draining", retryable=True)
    frame, end = rt(codec.end_message(3, "rejected", err))
    assert end.error == wire.ErrorBody(code="ERROR_CODE_DRAINING", message="draining", retryable=True)
    if encoding is Encoding.JSON:
        assert json.loads(frame)["error"] == {
            "code": "ERROR_CODE_DRAINING",
            "message": "draining",
            "retryable": True,
        }
    frame, res = rt(
        codec.result_ok("c", pb.ListLorasResponse(adapters=[pb.LoraAdapter(lora_id=1, lora_name="a")]))
    )
    assert res.ok and res.body == {"adapters": [{"loraId": "1", "loraName": "a"}]}
    if encoding is Encoding.JSON:
        assert json.loads(frame) == {"type": "result", "call": "c", "ok": True, "body": res.body}
    frame, res = rt(codec.result_error(2, codec.error_body(pb.ErrorCode.INVALID_ARGUMENT, "bad")))
    assert not res.ok and res.error.code == "ERROR_CODE_INVALID_ARGUMENT" and res.body is None
    if encoding is Encoding.JSON:
        assert json.loads(frame) == {
            "type": "result",
            "call": 2,
            "ok": False,
            "error": {"code": "ERROR_CODE_INVALID_ARGUMENT", "message": "bad", "retryable": False},
        }
    frame, pe = rt(wire.ProtocolErrorMessage(message="nope"))
    assert pe == wire.ProtocolErrorMessage(message="nope")


def test_error_body_forms() -> None:
    assert codec.error_body(5).code == "ERROR_CODE_OVERLOADED"
    assert codec.error_body("ERROR_CODE_INTERNAL").code == "ERROR_CODE_INTERNAL"
    assert codec.error_body(999).code == "ERROR_CODE_UNSPECIFIED"
    with pytest.raises(ValueError, match="outcome"):
        codec.end_message(1, "exploded")


@pytest.mark.parametrize("encoding", list(Encoding))
def test_client_messages_round_trip(encoding: Encoding) -> None:
    gen = wire.Generate(stream=1, request={"prompt": "x"}, metadata={"traceparent": "t"})
    cmd = codec.decode_frame(codec.encode(gen, encoding))
    assert isinstance(cmd, codec.GenerateCommand) and cmd.request.prompt == "x" and cmd.encoding is encoding
    assert json.loads(codec.encode(gen, Encoding.JSON)) == {
        "type": "generate",
        "stream": 1,
        "request": {"prompt": "x"},
        "metadata": {"traceparent": "t"},
    }
    assert isinstance(
        codec.decode_frame(codec.encode(wire.Cancel(stream="a"), encoding)), codec.CancelCommand
    )
    call = codec.decode_frame(codec.encode(wire.Call(call=3, method="health", params={}), encoding))
    assert isinstance(call, codec.CallCommand) and call.request == pb.HealthRequest()


def test_events_batch_decodes() -> None:
    items = [codec.event_message(1, RESPONSES["token"]), codec.event_message(2, RESPONSES["finished-eos"])]
    frame = codec.encode(wire.Events(items=items), Encoding.JSON)
    msg = codec.decode_server_frame(frame)
    assert isinstance(msg, wire.Events) and [e.stream for e in msg.items] == [1, 2]


@pytest.mark.parametrize("frame", ['{"type":"nope"}', '{"type":"end","stream":1}', b"\x81\xa4type\xa5event"])
def test_invalid_server_frames(frame: str | bytes) -> None:
    with pytest.raises(codec.ProtocolError):
        codec.decode_server_frame(frame)
    with pytest.raises(codec.FrameDecodeError):
        codec.decode_server_frame("{")


@pytest.mark.parametrize(
    ("encoding", "count"),
    [(e, n) for e in Encoding for n in (1, 3, 15, 16)] + [(Encoding.MSGPACK, 70_000)],  # msgpack array16/32
)
def test_coalesce_events(encoding: Encoding, count: int) -> None:
    names = list(RESPONSES)
    responses = [RESPONSES[names[i % len(names)]] for i in range(count)]
    enc = EventEncoder(4, encoding)
    frames = [enc.encode(r) for r in responses]
    msg = codec.decode_server_frame(codec.coalesce_events(frames, encoding))  # type: ignore[arg-type]
    assert isinstance(msg, wire.Events) and len(msg.items) == count
    for item, frame in zip(msg.items[:40], frames[:40], strict=False):
        assert item == codec.decode_server_frame(frame) or _nan_equal(
            msgspec.to_builtins(item), msgspec.to_builtins(codec.decode_server_frame(frame))
        )


@pytest.mark.parametrize("encoding", list(Encoding))
def test_nested_pb_messages_in_result_body(encoding: Encoding) -> None:
    body = {"snapshot": pb.KvBootstrap(room_id=2**64 - 1), "list": [pb.LoraAdapter(lora_id=5)]}
    res = codec.decode_server_frame(codec.encode(codec.result_ok(1, body), encoding))
    assert isinstance(res, wire.Result)
    assert res.body == {"snapshot": {"roomId": str(2**64 - 1)}, "list": [{"loraId": "5"}]}
