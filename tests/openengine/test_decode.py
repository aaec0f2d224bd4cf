"""The hand-written decoder of token events and finishes gives exactly what betterproto2's parser
gives, or declines."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.openengine import pb
from sidecar.openengine.schema.decode import decode_common_event

texts = st.text(max_size=12)
u32 = st.integers(min_value=0, max_value=2**32 - 1)
infos = st.lists(st.builds(pb.TokenInfo, token_id=u32, token=texts), max_size=4)
usages = st.builds(
    pb.Usage,
    prompt_tokens=u32,
    completion_tokens=u32,
    total_tokens=u32,
    cached_prompt_tokens=st.one_of(st.none(), u32),
    reasoning_tokens=st.one_of(st.none(), u32),
)
token_events = st.builds(
    pb.GenerateResponse,
    request_id=texts,
    token=st.builds(pb.TokenOutput, output_index=st.one_of(st.none(), u32), tokens=infos, text=texts),
    usage=st.one_of(st.none(), usages),
)
stop_matches = st.one_of(
    st.none(),
    st.builds(pb.StopMatch),
    st.builds(pb.StopMatch, stop_token_id=u32),
    st.builds(pb.StopMatch, stop_text=texts),
    st.builds(pb.StopMatch, eos_token_id=u32),
)
finishes = st.builds(
    pb.GenerateResponse,
    request_id=texts,
    finished=st.builds(
        pb.GenerationFinished,
        output_index=st.one_of(st.none(), u32),
        reason=st.sampled_from(list(pb.FinishReason)),
        message=texts,
        stop_match=stop_matches,
    ),
    usage=st.one_of(st.none(), usages),
)


@settings(max_examples=400, deadline=None)
@given(st.one_of(token_events, finishes))
def test_token_events_and_finishes_decode_identically(msg: pb.GenerateResponse) -> None:
    data = bytes(msg)
    fast = decode_common_event(data)
    assert fast is not None
    assert fast == pb.GenerateResponse.parse(data)
    assert bytes(fast) == data


@pytest.mark.parametrize(
    "msg",
    [
        pb.GenerateResponse(
            request_id="r", token=pb.TokenOutput(output_index=0, tokens=[pb.TokenInfo(logprob=-0.5)])
        ),
        pb.GenerateResponse(request_id="r", prompt=pb.PromptOutput(tokens=[pb.TokenInfo(token_id=1)])),
        pb.GenerateResponse(request_id="r", prefill_ready=pb.PrefillReady()),
        pb.GenerateResponse(request_id="r", error=pb.EngineError(code=pb.ErrorCode.INTERNAL)),
        pb.GenerateResponse(request_id="r"),
    ],
)
def test_other_messages_are_declined(msg: pb.GenerateResponse) -> None:
    assert decode_common_event(bytes(msg)) is None


def test_unknown_enum_values_and_repeated_fields_are_declined() -> None:
    unknown = bytes(pb.GenerateResponse(request_id="r", finished=pb.GenerationFinished(reason=9)))
    assert decode_common_event(unknown) is None and pb.GenerateResponse.parse(unknown).finished is not None
    usage = bytes(pb.GenerateResponse(usage=pb.Usage(total_tokens=1)))
    finish = bytes(pb.GenerateResponse(finished=pb.GenerationFinished(output_index=0)))
    assert decode_common_event(finish + usage + usage) is None  # a repeated message merges: generic
    assert decode_common_event(finish + usage) == pb.GenerateResponse.parse(finish + usage)
    token = bytes(pb.GenerateResponse(token=pb.TokenOutput(output_index=0)))
    assert decode_common_event(token + finish) is None  # two events of the oneof: generic


def test_unknown_field_and_truncation_are_declined() -> None:
    data = bytes(pb.GenerateResponse(request_id="r", token=pb.TokenOutput(output_index=1, text="hé")))
    assert decode_common_event(data + b"\xa0\x06\x01") is None  # field 100: keep it via the generic parser
    rng = random.Random(7)
    for cut in range(1, len(data)):
        out = decode_common_event(data[:cut])
        assert out is None or out == pb.GenerateResponse.parse(data[:cut])
    for _ in range(200):
        noisy = bytearray(data)
        noisy[rng.randrange(len(noisy))] = rng.randrange(256)
        out = decode_common_event(bytes(noisy))
        if out is not None:
            assert out == pb.GenerateResponse.parse(bytes(noisy))
