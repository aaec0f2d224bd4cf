"""The hand-written GenerateRequest encoder writes exactly betterproto2's bytes, or declines."""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.openengine import pb
from sidecar.openengine.schema.encode import encode_generate_request

texts = st.text(max_size=12)
u32 = st.integers(min_value=0, max_value=2**32 - 1)
i32 = st.integers(min_value=-(2**31), max_value=2**31 - 1)
u64 = st.integers(min_value=0, max_value=2**64 - 1)
doubles = st.floats(allow_nan=False)
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
    }
    for cls, names in known.items():
        assert {f.name for f in dataclasses.fields(cls)} == names, cls.__name__
