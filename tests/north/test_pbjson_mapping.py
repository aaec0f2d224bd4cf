"""Proto3 JSON mapping (sidecar.north.pbjson): strict input, proto3 output rules."""

from __future__ import annotations

import base64
import math

import pytest

from sidecar.north.pbjson import MAX_DEPTH, PbJsonError, decode_base64, message_from_json, message_to_json
from sidecar.openengine import pb


def test_generate_request_full_round_trip() -> None:
    d = {
        "requestId": "r1",
        "model": "m",
        "prompt": "Hello",
        "sampling": {"temperature": 0.5, "topK": 0, "seed": "18446744073709551615", "numSequences": 2},
        "stopping": {
            "maxTokens": 16,
            "conditions": [{"stopText": "\n"}, {"stopTokenId": 0}],
            "ignoreEos": False,
        },
        "response": {
            "returnOutputLogprobs": True,
            "outputCandidates": {"topN": 5},
            "promptCandidates": {"all": {}},
        },
        "kv": {"bypassPrefixCache": True, "cacheSalt": "s"},
        "guided": {"choice": {"choices": ["a", "b"]}, "backend": "xgrammar"},
        "media": [
            {"modality": "MODALITY_IMAGE", "url": "http://x/y.png", "uuid": "h1"},
            {"modality": "MODALITY_AUDIO", "rawBytes": base64.b64encode(b"\x00\x01\xff").decode()},
        ],
        "loraName": "ad",
        "extra": {"a": 1, "b": [True, None, "x", {"c": 2.5}]},
        "mediaOptions": {"image": {"detail": "high"}},
    }
    msg = message_from_json(pb.GenerateRequest, d)
    assert msg.sampling is not None and msg.sampling.seed == 2**64 - 1
    assert msg.sampling.top_k == 0  # present zero kept (proto3 optional)
    assert msg.media[1].raw_bytes == b"\x00\x01\xff"
    assert msg.media[0].modality == pb.Modality.IMAGE
    assert msg.stopping is not None and msg.stopping.conditions[1].stop_token_id == 0
    out = message_to_json(msg)
    assert out == d
    # and it agrees with betterproto2's own (slow) mapping
    assert out == msg.to_dict()
    assert bytes(message_from_json(pb.GenerateRequest, out)) == bytes(msg)


def test_snake_case_names_accepted() -> None:
    msg = message_from_json(pb.GenerateRequest, {"request_id": "r", "stopping": {"max_tokens": 3}})
    assert msg.request_id == "r" and msg.stopping is not None and msg.stopping.max_tokens == 3


def test_int64_as_string_and_number_and_integral_float() -> None:
    for v in ("42", 42, 42.0):
        msg = message_from_json(pb.SamplingParams, {"seed": v})
        assert msg.seed == 42
    assert message_to_json(pb.SamplingParams(seed=42)) == {"seed": "42"}
    assert message_to_json(pb.KvBootstrap(room_id=2**63)) == {"roomId": str(2**63)}


def test_uint32_stays_a_number() -> None:
    assert message_to_json(pb.StoppingOptions(max_tokens=7)) == {"maxTokens": 7}
    assert message_from_json(pb.StoppingOptions, {"maxTokens": "7"}).max_tokens == 7


def test_enums_by_name_and_number() -> None:
    assert message_from_json(pb.MediaItem, {"modality": "MODALITY_VIDEO"}).modality == pb.Modality.VIDEO
    assert message_from_json(pb.MediaItem, {"modality": 3}).modality == pb.Modality.AUDIO
    unknown = message_from_json(pb.MediaItem, {"modality": 99}).modality
    assert int(unknown) == 99
    assert message_to_json(pb.MediaItem(modality=unknown)) == {"modality": 99}
    assert message_to_json(pb.EngineError(code=pb.ErrorCode.DRAINING)) == {"code": "ERROR_CODE_DRAINING"}
    assert message_to_json(pb.EngineError()) == {}  # enum zero omitted


def test_presence_of_optional_zero() -> None:
    assert message_to_json(pb.TokenOutput(output_index=0)) == {"outputIndex": 0}
    assert message_to_json(pb.TokenOutput()) == {}
    assert message_to_json(pb.StopMatch(stop_token_id=0)) == {"stopTokenId": 0}  # oneof member
    assert message_to_json(pb.Usage(cached_prompt_tokens=0)) == {"cachedPromptTokens": 0}
    assert message_to_json(pb.Usage(prompt_tokens=0)) == {}  # plain scalar zero omitted
    assert message_to_json(pb.PrefillReady(kv_session=pb.KvSessionRef())) == {"kvSession": {}}


def test_bytes_base64_variants() -> None:
    raw = bytes(range(256))
    for text in (
        base64.b64encode(raw).decode(),
        base64.urlsafe_b64encode(raw).decode(),
        base64.b64encode(raw).decode().rstrip("="),
    ):
        assert message_from_json(pb.KvBlockHash, {"value": text}).value == raw
    assert message_from_json(pb.KvBlockHash, {"value": raw}).value == raw  # msgpack bin
    assert message_to_json(pb.KvBlockHash(value=b"\xff\x00")) == {"value": "/wA="}
    assert decode_base64("") == b""


def test_float_specials() -> None:
    msg = message_from_json(pb.LogProb, {"logprob": "-Infinity"})
    assert msg.logprob == -math.inf
    assert math.isnan(message_from_json(pb.LogProb, {"logprob": "NaN"}).logprob)
    assert message_from_json(pb.LogProb, {"logprob": "1.5"}).logprob == 1.5
    assert message_to_json(pb.LogProb(logprob=-math.inf)) == {"logprob": "-Infinity"}
    assert message_to_json(pb.LogProb(logprob=math.inf)) == {"logprob": "Infinity"}
    assert message_to_json(pb.LogProb(logprob=math.nan)) == {"logprob": "NaN"}


def test_null_means_absent() -> None:
    msg = message_from_json(
        pb.GenerateRequest, {"prompt": None, "tokenIds": {"ids": [1, 2]}, "sampling": None}
    )
    assert msg.prompt is None and msg.token_ids is not None and msg.sampling is None


@pytest.mark.parametrize(
    ("cls", "value", "needle"),
    [
        (pb.GenerateRequest, [], "expected an object"),
        (pb.GenerateRequest, {"nope": 1}, "unknown field 'nope'"),
        (pb.GenerateRequest, {"model": 5}, "model: expected a string"),
        (pb.GenerateRequest, {"prompt": "a", "tokenIds": {"ids": [1]}}, "oneof 'input'"),
        (pb.GenerateRequest, {"requestId": "a", "request_id": "b"}, "given twice"),
        (pb.GenerateRequest, {"media": {}}, "media: expected an array"),
        (pb.GenerateRequest, {"media": [None]}, "media[0]: expected an object"),
        (pb.GenerateRequest, {"tokenIds": {"ids": [1, -1]}}, "ids[1]: -1 is out of range for uint32"),
        (pb.GenerateRequest, {"tokenIds": {"ids": [2**32]}}, "out of range for uint32"),
        (pb.GenerateRequest, {"tokenIds": {"ids": [1.5]}}, "expected an integer"),
        (pb.GenerateRequest, {"tokenIds": {"ids": ["1e3"]}}, "expected an integer"),
        (pb.GenerateRequest, {"tokenIds": {"ids": [True]}}, "expected an integer"),
        (pb.GenerateRequest, {"sampling": {"seed": str(2**64)}}, "out of range for uint64"),
        (pb.GenerateRequest, {"sampling": {"temperature": "hot"}}, "sampling.temperature: expected a number"),
        (pb.GenerateRequest, {"sampling": {"temperature": True}}, "expected a number"),
        (pb.GenerateRequest, {"stopping": {"ignoreEos": 1}}, "expected a boolean"),
        (pb.GenerateRequest, {"media": [{"modality": "MODALITY_SMELL"}]}, "unknown Modality value"),
        (pb.GenerateRequest, {"media": [{"modality": 1.0}]}, "expected an enum name"),
        (pb.GenerateRequest, {"media": [{"rawBytes": "!!!"}]}, "media[0].rawBytes: invalid base64"),
        (pb.GenerateRequest, {"media": [{"rawBytes": "A"}]}, "invalid base64"),
        (pb.GenerateRequest, {"media": [{"rawBytes": 5}]}, "expected base64 bytes"),
        (pb.GenerateRequest, {"extra": []}, "extra: expected an object"),
        (pb.GenerateRequest, {"extra": {"x": float("inf")}}, "finite"),
        (pb.GenerateRequest, {"extra": {"x": b"raw"}}, "is not a JSON value"),
        (pb.GenerateRequest, {"extra": {1: "x"}}, "keys must be strings"),
        (pb.GenerateRequest, {1: "x"}, "unknown field '1'"),
        (pb.KvEndpoint, {"port": 2**32}, "port: 4294967296 is out of range"),
        (pb.LogProb, {"logprob": 1e39 * 1e300}, None),
    ],
)
def test_invalid_input(cls: type, value: object, needle: str | None) -> None:
    if needle is None:  # inf as a plain float is accepted for double (msgpack can carry it)
        message_from_json(cls, value)
        return
    with pytest.raises(PbJsonError) as info:
        message_from_json(cls, value, path="request")
    assert needle in str(info.value)
    assert str(info.value).startswith("request")


def test_float32_range() -> None:
    # No float32 field in the OpenEngine schema: exercise the reader directly.
    from sidecar.north.pbjson import _float_reader

    assert _float_reader("float")(1e38, "f", 0) == 1e38
    with pytest.raises(PbJsonError, match="out of range for float"):
        _float_reader("float")(1e39, "f", 0)


def test_nesting_limit() -> None:
    deep: object = "leaf"
    for _ in range(MAX_DEPTH + 2):
        deep = {"k": deep}
    with pytest.raises(PbJsonError, match="nested deeper"):
        message_from_json(pb.GenerateRequest, {"extra": deep})
    shallow: object = "leaf"
    for _ in range(MAX_DEPTH - 2):
        shallow = [shallow]
    message_from_json(pb.GenerateRequest, {"extra": {"k": shallow}})


def test_struct_round_trip_keeps_types() -> None:
    d = {"n": 1.5, "s": "x", "b": False, "z": None, "l": [1.0, "two", [3.0]], "o": {"p": {}}}
    msg = message_from_json(pb.Struct, d)
    assert message_to_json(msg) == d


def test_value_and_list_value_are_written_as_fields_only() -> None:
    # their proto3 JSON form is not an object: message_to_json promises one
    for msg in (pb.Value(string_value="x"), pb.ListValue(values=[pb.Value(number_value=1.0)])):
        with pytest.raises(TypeError, match="not an object"):
            message_to_json(msg)
    assert message_to_json(pb.Struct(fields={"v": pb.Value(list_value=pb.ListValue())})) == {"v": []}


def test_kv_session_ref_json() -> None:
    ref = pb.KvSessionRef(
        session_id="s",
        transfer_backend="nixl",
        endpoints=[pb.KvEndpoint(host="h", port=1, protocol="tcp")],
        dp_rank=0,
        attributes_struct=pb.Struct.from_dict({"remote_block_ids": [1, 2], "big": "123456789012345678901"}),
        handoff_profile="vllm.kv_transfer_params.v1",
        bootstrap=pb.KvBootstrap(endpoint=pb.KvEndpoint(host="b", port=2), room_id=2**63 + 5),
    )
    out = message_to_json(ref)
    assert out["bootstrap"]["roomId"] == str(2**63 + 5)
    assert "dpRank" not in out
    assert out["attributesStruct"] == {"remote_block_ids": [1.0, 2.0], "big": "123456789012345678901"}
    assert message_from_json(pb.KvSessionRef, out) == ref


def test_call_params_messages() -> None:
    req = message_from_json(
        pb.LoadLoraRequest, {"adapter": {"loraId": "7", "loraName": "a", "sourcePath": "/models/a"}}
    )
    assert req.adapter is not None and req.adapter.lora_id == 7
    assert message_to_json(req) == {"adapter": {"loraId": "7", "loraName": "a", "sourcePath": "/models/a"}}
    assert message_from_json(pb.HealthRequest, {"role": "ENGINE_ROLE_DECODE"}).role == pb.EngineRole.DECODE
