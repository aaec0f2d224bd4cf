"""The hand-written GenerateRequest and GenerateResponse encoders write exactly betterproto2's bytes, or decline."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.openengine import pb
from sidecar.openengine.schema.encode import encode_generate_request, encode_generate_response

texts = st.text(max_size=12)
u32 = st.integers(min_value=0, max_value=2**32 - 1)
i32 = st.integers(min_value=-(2**31), max_value=2**31 - 1)
u64 = st.integers(min_value=0, max_value=2**64 - 1)
doubles = st.floats(allow_nan=False)
any_doubles = st.floats()  # NaN, ±0.0, infinities
opt = st.one_of

sampling = st.builds(
    pb.SamplingParams,
    temperature=opt(st.none(), doubles),
    top_p=opt(st.none(), doubles),
    top_k=opt(st.none(), i32),
    min_p=opt(st.none(), doubles),
    frequency_penalty=opt(st.none(), doubles),
    presence_penalty=opt(st.none(), doubles),
    repetition_penalty=opt(st.none(), doubles),
    seed=opt(st.none(), u64),
    num_sequences=opt(st.none(), u32),
)
conditions = st.lists(
    st.one_of(
        st.builds(pb.StopCondition, stop_text=texts),
        st.builds(pb.StopCondition, stop_token_id=u32),
        st.builds(pb.StopCondition),
    ),
    max_size=3,
)
stopping = st.builds(
    pb.StoppingOptions,
    max_tokens=opt(st.none(), u32),
    min_tokens=opt(st.none(), u32),
    conditions=conditions,
    ignore_eos=opt(st.none(), st.booleans()),
    include_stop_in_output=opt(st.none(), st.booleans()),
)
requests = st.builds(
    pb.GenerateRequest,
    request_id=texts,
    model=texts,
    prompt=opt(st.none(), texts),
    sampling=opt(st.none(), sampling),
    stopping=opt(st.none(), stopping),
    lora_name=texts,
)
token_requests = st.builds(
    pb.GenerateRequest,
    request_id=texts,
    token_ids=st.builds(pb.TokenIds, ids=st.lists(u32, max_size=20)),
    stopping=opt(st.none(), stopping),
)


@settings(max_examples=400, deadline=None)
@given(st.one_of(requests, token_requests))
def test_plain_requests_encode_identically(request: pb.GenerateRequest) -> None:
    assert encode_generate_request(request) == bytes(request)


def test_other_requests_are_declined() -> None:
    declined = [
        pb.GenerateRequest(prompt="x", response=pb.ResponseOptions(return_output_logprobs=True)),
        pb.GenerateRequest(prompt="x", kv=pb.KvOptions(cache_salt="s")),
        pb.GenerateRequest(prompt="x", guided=pb.GuidedDecoding(regex="a")),
        pb.GenerateRequest(prompt="x", media=[pb.MediaItem(url="http://x")]),
        pb.GenerateRequest(prompt="x", extra=pb.Struct.from_dict({"a": 1})),
        pb.GenerateRequest(prompt="x", media_options=pb.Struct.from_dict({"image": {}})),
    ]
    for request in declined:
        assert encode_generate_request(request) is None
    with_unknown = pb.GenerateRequest.parse(bytes(pb.GenerateRequest(prompt="x")) + b"\xa0\x06\x01")
    assert encode_generate_request(with_unknown) is None  # unknown fields: betterproto2 keeps them
    stopping_unknown = pb.StoppingOptions.parse(b"\x08\x05\xa0\x06\x01")
    assert encode_generate_request(pb.GenerateRequest(prompt="x", stopping=stopping_unknown)) is None


candidates = st.builds(
    pb.LogProb,
    token_id=u32,
    logprob=st.one_of(st.just(0.0), st.just(-0.0), any_doubles),
    token=texts,
    rank=opt(st.none(), u32),
)
token_infos = st.builds(
    pb.TokenInfo,
    token_id=u32,
    token=texts,
    logprob=opt(st.none(), any_doubles),
    rank=opt(st.none(), u32),
    candidates=st.lists(candidates, max_size=3),
)
token_outputs = st.builds(
    pb.TokenOutput,
    output_index=opt(st.none(), u32),
    tokens=st.lists(token_infos, max_size=4),
    text=texts,
)
stop_matches = st.one_of(
    st.builds(pb.StopMatch, stop_token_id=u32),
    st.builds(pb.StopMatch, stop_text=texts),
    st.builds(pb.StopMatch, eos_token_id=u32),
    st.builds(pb.StopMatch),
)
finished = st.builds(
    pb.GenerationFinished,
    output_index=opt(st.none(), u32),
    reason=st.sampled_from(list(pb.FinishReason)),
    message=texts,
    stop_match=opt(st.none(), stop_matches),
)
usages = st.builds(
    pb.Usage,
    prompt_tokens=u32,
    completion_tokens=u32,
    total_tokens=u32,
    cached_prompt_tokens=opt(st.none(), u32),
    reasoning_tokens=opt(st.none(), u32),
)
responses = st.one_of(
    st.builds(pb.GenerateResponse, request_id=texts, token=token_outputs, usage=opt(st.none(), usages)),
    st.builds(pb.GenerateResponse, request_id=texts, finished=finished, usage=opt(st.none(), usages)),
    st.builds(pb.GenerateResponse, request_id=texts, usage=opt(st.none(), usages)),
)


@settings(max_examples=600, deadline=None)
@given(responses)
def test_token_finished_and_usage_events_encode_identically(response: pb.GenerateResponse) -> None:
    assert encode_generate_response(response) == bytes(response)


def test_other_responses_are_declined() -> None:
    declined = [
        pb.GenerateResponse(request_id="r", prompt=pb.PromptOutput(tokens=[pb.TokenInfo(token_id=1)])),
        pb.GenerateResponse(request_id="r", prefill_ready=pb.PrefillReady()),
        pb.GenerateResponse(request_id="r", error=pb.EngineError(message="x")),
        # values betterproto2 writes its own way: a negative unsigned integer, a lone surrogate
        pb.GenerateResponse(token=pb.TokenOutput(tokens=[pb.TokenInfo(token_id=-1)])),
        pb.GenerateResponse(request_id="\ud800", token=pb.TokenOutput(text="a")),
    ]
    for response in declined:
        assert encode_generate_response(response) is None
    unknown = bytes(pb.GenerateResponse(request_id="r")) + b"\xa0\x06\x01"
    assert encode_generate_response(pb.GenerateResponse.parse(unknown)) is None
    info_unknown = pb.TokenInfo.parse(b"\x08\x05\xa0\x06\x01")
    nested = pb.GenerateResponse(token=pb.TokenOutput(tokens=[info_unknown]))
    assert encode_generate_response(nested) is None


def test_an_engine_server_sends_the_encoders_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine server's codec writes the encoder's bytes, and betterproto2's where it declines."""
    from sidecar.openengine.serving import grpc_server

    token = pb.GenerateResponse(request_id="r", token=pb.TokenOutput(output_index=0, text="hi"))
    prompt = pb.GenerateResponse(request_id="r", prompt=pb.PromptOutput())
    codec = grpc_server._Codec()
    assert codec.encode(token, pb.GenerateResponse) == bytes(token)
    assert codec.encode(prompt, pb.GenerateResponse) == bytes(prompt)
    seen: list[pb.GenerateResponse] = []

    def spy(message: pb.GenerateResponse) -> bytes | None:
        seen.append(message)
        return encode_generate_response(message)

    monkeypatch.setattr(grpc_server, "encode_generate_response", spy)
    assert codec.encode(token, pb.GenerateResponse) == bytes(token)
    assert codec.encode(prompt, pb.GenerateResponse) == bytes(prompt)
    assert seen == [token, prompt]


def test_the_encoder_knows_every_field_of_the_schema() -> None:
    """A field added to the schema must be taught to the encoder (or declined), never dropped."""

    known = {
        pb.GenerateRequest: {
            "request_id",
            "model",
            "prompt",
            "token_ids",
            "sampling",
            "stopping",
            "lora_name",
        }
        | {"response", "kv", "guided", "media", "extra", "media_options"},  # declined: betterproto2
        pb.SamplingParams: {
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "frequency_penalty",
            "presence_penalty",
            "repetition_penalty",
            "seed",
            "num_sequences",
        },
        pb.StoppingOptions: {
            "max_tokens",
            "min_tokens",
            "conditions",
            "ignore_eos",
            "include_stop_in_output",
        },
        pb.StopCondition: {"stop_text", "stop_token_id"},
        pb.TokenIds: {"ids"},
        pb.GenerateResponse: {"request_id", "token", "finished", "usage"}
        | {"prompt", "prefill_ready", "error"},  # declined: betterproto2
        pb.TokenOutput: {"output_index", "tokens", "text"},
        pb.TokenInfo: {"token_id", "token", "logprob", "rank", "candidates"},
        pb.LogProb: {"token_id", "logprob", "token", "rank"},
        pb.GenerationFinished: {"output_index", "reason", "message", "stop_match"},
        pb.StopMatch: {"stop_token_id", "stop_text", "eos_token_id"},
        pb.Usage: {
            "prompt_tokens",
            "completion_tokens",
            "total_tokens",
            "cached_prompt_tokens",
            "reasoning_tokens",
        },
    }
    for cls, names in known.items():
        assert {f.name for f in dataclasses.fields(cls)} == names, cls.__name__
