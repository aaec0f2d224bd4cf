"""Property-based tests of admission (``sidecar.core.admission.admit``) and metadata checks.

Any request that decodes (any shape the proto3 JSON mapping lets through: odd numbers, empty
lists, conflicting options, unknown models, hostile metadata), on workers of every engine
shape and role: ``admit`` returns ``Admitted`` or raises a typed ``Rejection`` with one of the
admission codes, and never mutates the request. The full north path (decode, then admit) is
covered too, so a frame can never get past the codec into an untyped failure.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from sidecar.core.admission import Admitted, admit
from sidecar.core.card import WorkerCard
from sidecar.core.errors import Rejection
from sidecar.core.metadata import normalize_metadata
from sidecar.north import codec
from sidecar.north.pbjson import PbJsonError, message_from_json
from sidecar.openengine import pb
from tests.core.shapes import R, sglang_card, trtllm_card, vllm_card
from tests.fuzz import strategies as S

E = pb.ErrorCode
ADMISSION_CODES = {E.INVALID_ARGUMENT, E.UNSUPPORTED_FEATURE, E.ROLE_MISMATCH, E.MODEL_NOT_FOUND}
CARDS: dict[str, WorkerCard] = {
    "vllm": vllm_card(),
    "vllm-dp2": vllm_card(dp=2),
    "vllm-prefill": vllm_card(R.PREFILL),
    "vllm-decode": vllm_card(R.DECODE),
    "trtllm": trtllm_card(),
    "trtllm-decode": trtllm_card(R.DECODE),
    "sglang": sglang_card(R.AGGREGATED),
    "sglang-prefill": sglang_card(R.PREFILL),
}
NAMES = sorted(
    {n for c in CARDS.values() for n in c.served_model_names}
    | {a.lora_name for c in CARDS.values() for a in (c.lora_adapters or [])}
)
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def requests(draw: st.DrawFn) -> pb.GenerateRequest:
    """A GenerateRequest that decodes: drawn from the schema, with a model a worker may serve."""
    body = draw(S.pb_json(pb.GenerateRequest, valid=True, sparse=draw(st.booleans())))
    choice = draw(st.integers(0, 3))
    if choice:
        body["model"] = draw(st.sampled_from(["", *NAMES]))
    if draw(st.booleans()):
        body.pop("tokenIds", None)
        body["prompt"] = draw(st.text(max_size=20))
    try:
        return message_from_json(pb.GenerateRequest, body, path="request")
    except PbJsonError:
        return pb.GenerateRequest(model=body.get("model", ""), prompt="fallback")


def _admit(request: pb.GenerateRequest, metadata: Any, card: WorkerCard) -> Admitted | Rejection:
    before = bytes(request)
    try:
        result: Admitted | Rejection = admit(request, metadata, card)
    except Rejection as rejection:
        result = rejection
    assert bytes(request) == before, "admission mutated the request"
    if isinstance(result, Rejection):
        assert result.code in ADMISSION_CODES, result.code
        assert result.message and not result.retryable
    else:
        bytes(result.request)  # what goes to the engine serializes
        assert result.model.served_model_name in card.served_model_names
        assert result.num_sequences >= 1
        for key, value in result.metadata.pairs:
            assert key == key.lower() and value.isprintable() and value.isascii()
    return result


@SETTINGS
@given(requests(), st.one_of(st.none(), S.metadata))
def test_admission_answers_admitted_or_a_typed_rejection(request: pb.GenerateRequest, metadata: Any) -> None:
    for card in CARDS.values():
        result = _admit(request, metadata, card)
        event("admitted" if isinstance(result, Admitted) else f"rejected {result.code.name}")


@SETTINGS
@given(
    st.one_of(
        S.metadata,
        st.dictionaries(S.json_scalars, S.json_scalars, max_size=4),
        st.lists(st.tuples(S.json_scalars, S.json_scalars), max_size=4),
    )
)
def test_metadata_checks_raise_only_rejections(metadata: Any) -> None:
    for ranks in (None, [0], [0, 1], []):
        try:
            meta = normalize_metadata(metadata, dp_ranks=ranks)
        except Rejection as rejection:
            assert rejection.code == E.INVALID_ARGUMENT
            continue
        assert meta.target_dp_rank is None or ranks is None or meta.target_dp_rank in ranks


@SETTINGS
@given(
    S.generate_messages(valid_request=True),
    S.valid_ids,
    st.sampled_from(sorted(CARDS)),
    st.sampled_from(["", *NAMES]),
)
def test_decode_then_admit(message: dict[str, Any], stream: Any, card_name: str, model: str) -> None:
    """The server's whole path for one ``generate`` frame: decode, then admit."""
    message["stream"] = stream
    if isinstance(message.get("request"), dict):
        message["request"]["model"] = model
    try:
        frame = json.dumps(message)
    except (ValueError, OverflowError):
        return
    try:
        cmd = codec.decode_frame(frame)
    except (codec.FrameDecodeError, codec.ProtocolError):
        return
    if isinstance(cmd, codec.GenerateCommand):
        result = _admit(cmd.request, cmd.metadata, CARDS[card_name])
        event("admitted" if isinstance(result, Admitted) else f"rejected {result.code.name}")


@pytest.mark.parametrize(
    ("request_json", "code"),
    [
        ({"prompt": "x", "stopping": {"maxTokens": 4294967295}}, E.INVALID_ARGUMENT),
        ({"prompt": "x", "stopping": {"maxTokens": 2, "minTokens": 3}}, E.INVALID_ARGUMENT),
        ({"prompt": "x", "sampling": {"numSequences": 0}}, E.INVALID_ARGUMENT),
        ({"prompt": "x", "sampling": {"numSequences": 4294967295}}, E.UNSUPPORTED_FEATURE),
        ({"prompt": "x", "sampling": {"temperature": "NaN"}}, E.INVALID_ARGUMENT),
        ({"prompt": "x", "sampling": {"topP": "Infinity"}}, E.INVALID_ARGUMENT),
        ({"prompt": "x", "sampling": {"temperature": -1e308}}, E.INVALID_ARGUMENT),
        ({"tokenIds": {"ids": []}}, E.INVALID_ARGUMENT),
        ({"tokenIds": {"ids": [4294967295] * 200_000}}, E.INVALID_ARGUMENT),
        ({}, E.INVALID_ARGUMENT),
        (
            {
                "prompt": "x",
                "response": {"returnOutputLogprobs": True, "outputCandidates": {"topN": 4294967295}},
            },
            E.UNSUPPORTED_FEATURE,
        ),
        ({"prompt": "x", "guided": {"jsonSchema": "{"}}, E.INVALID_ARGUMENT),
        ({"prompt": "x", "model": "x" * 10_000}, E.MODEL_NOT_FOUND),
    ],
)
def test_extreme_values_are_typed_rejections(request_json: dict[str, Any], code: pb.ErrorCode) -> None:
    request = message_from_json(pb.GenerateRequest, {"model": "llama", **request_json}, path="request")
    result = _admit(request, None, CARDS["vllm"])
    assert isinstance(result, Rejection) and result.code == code, result
