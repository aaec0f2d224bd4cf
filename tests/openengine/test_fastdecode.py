"""The hand-written token-event decoder gives exactly what betterproto2's parser gives, or declines."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.openengine import pb
from sidecar.openengine.fastdecode import decode_token_event

texts = st.text(max_size=12)
u32 = st.integers(min_value=0, max_value=2**32 - 1)
infos = st.lists(st.builds(pb.TokenInfo, token_id=u32, token=texts), max_size=4)
token_events = st.builds(
    pb.GenerateResponse,
    request_id=texts,
    token=st.builds(pb.TokenOutput, output_index=st.one_of(st.none(), u32), tokens=infos, text=texts),
)


@settings(max_examples=300, deadline=None)
@given(token_events)
def test_plain_token_events_decode_identically(msg: pb.GenerateResponse) -> None:
    data = bytes(msg)
    fast = decode_token_event(data)
    assert fast is not None
    assert fast == pb.GenerateResponse.parse(data)
    assert bytes(fast) == data


@pytest.mark.parametrize(
    "msg",
    [
        pb.GenerateResponse(
            request_id="r", token=pb.TokenOutput(output_index=0, tokens=[pb.TokenInfo(logprob=-0.5)])
        ),
        pb.GenerateResponse(
            request_id="r", token=pb.TokenOutput(output_index=0), usage=pb.Usage(total_tokens=1)
        ),
        pb.GenerateResponse(request_id="r", finished=pb.GenerationFinished(output_index=0)),
        pb.GenerateResponse(request_id="r", prefill_ready=pb.PrefillReady()),
        pb.GenerateResponse(request_id="r", error=pb.EngineError(code=pb.ErrorCode.INTERNAL)),
        pb.GenerateResponse(request_id="r"),
    ],
)
def test_other_messages_are_declined(msg: pb.GenerateResponse) -> None:
    assert decode_token_event(bytes(msg)) is None


def test_unknown_field_and_truncation_are_declined() -> None:
    data = bytes(pb.GenerateResponse(request_id="r", token=pb.TokenOutput(output_index=1, text="hé")))
    assert decode_token_event(data + b"\xa0\x06\x01") is None  # field 100: keep it via the generic parser
    rng = random.Random(7)
    for cut in range(1, len(data)):
        out = decode_token_event(data[:cut])
        assert out is None or out == pb.GenerateResponse.parse(data[:cut])
    for _ in range(200):
        noisy = bytearray(data)
        noisy[rng.randrange(len(noisy))] = rng.randrange(256)
        out = decode_token_event(bytes(noisy))
        if out is not None:
            assert out == pb.GenerateResponse.parse(bytes(noisy))
