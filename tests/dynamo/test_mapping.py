"""Dynamo request ↔ GenerateRequest and engine events ↔ Dynamo chunks (no Dynamo needed)."""

from __future__ import annotations

import base64
from typing import Any

import pytest

from sidecar.core.admission import admit
from sidecar.core.errors import Rejection
from sidecar.core.handoff import splice_kv_session
from sidecar.core.lifecycle import CANCELLED, FAILED, REJECTED, Outcome
from sidecar.dynamo.mapping import KV_SESSION_KEY, ChunkMerger, chunk_of, error_kind, to_generate_request
from sidecar.openengine import pb
from tests.dynamo.helpers import mock_card

NULLS = {
    "stop_conditions": {
        "max_tokens": 12,
        "stop": None,
        "stop_token_ids": None,
        "stop_token_ids_visible": None,
        "stop_token_ids_hidden": [2],
        "min_tokens": None,
        "ignore_eos": None,
        "max_thinking_tokens": None,
    },
    "sampling_options": {
        "n": None,
        "best_of": None,
        "presence_penalty": None,
        "frequency_penalty": None,
        "repetition_penalty": None,
        "temperature": None,
        "top_p": None,
        "top_k": None,
        "min_p": None,
        "use_beam_search": None,
        "length_penalty": None,
        "seed": None,
        "include_stop_str_in_output": None,
        "guided_decoding": None,
    },
    "output_options": {"logprobs": None, "prompt_logprobs": None, "skip_special_tokens": None},
    "eos_token_ids": [2],
    "annotations": [],
    "routing": {},
}


def dynamo_request(**overrides: Any) -> dict[str, Any]:
    req: dict[str, Any] = {"model": "Qwen/Qwen3-0.6B", "token_ids": [338, 114, 372], **NULLS}
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(req.get(key), dict):
            req[key] = {**req[key], **value}
        else:
            req[key] = value
    return req


def test_plain_completion_maps_and_is_admitted() -> None:
    card = mock_card()
    mapped = to_generate_request(dynamo_request(), card, request_id="ctx-1")
    req = mapped.request
    assert req.request_id == "ctx-1" and req.model == "Qwen/Qwen3-0.6B"
    assert req.token_ids is not None and req.token_ids.ids == [338, 114, 372]
    assert req.stopping == pb.StoppingOptions(max_tokens=12)  # EOS (hidden stop id 2) is the engine's rule
    assert req.sampling is None and req.response is None and req.guided is None and req.kv is None
    assert mapped.metadata == {}
    admit(req, mapped.metadata, card)  # nothing the card refuses


def test_sampling_stopping_logprobs_guided_routing_trace() -> None:
    card = mock_card(dp_size=2)
    req = dynamo_request(
        sampling_options={"temperature": 0.5, "top_p": 0.9, "top_k": -1, "seed": 7, "n": 2, "min_p": 0.1},
        stop_conditions={
            "stop": ["xx", "yy"],
            "stop_token_ids": [9, 2],
            "min_tokens": 3,
            "ignore_eos": True,
        },
        output_options={"logprobs": 2, "prompt_logprobs": 0},
        routing={"dp_rank": 1, "priority": 5},
    )
    req["sampling_options"]["guided_decoding"] = {"json": {"type": "object"}, "backend": "xgrammar"}
    mapped = to_generate_request(req, card, trace_headers={"traceparent": "00-ab-cd-01", "x-other": "z"})
    r = mapped.request
    assert r.sampling == pb.SamplingParams(temperature=0.5, top_p=0.9, min_p=0.1, seed=7, num_sequences=2)
    assert r.stopping is not None
    assert [c.stop_text for c in r.stopping.conditions[:2]] == ["xx", "yy"]
    assert [c.stop_token_id for c in r.stopping.conditions[2:]] == [9]
    assert r.stopping.min_tokens == 3 and r.stopping.ignore_eos is True and r.stopping.max_tokens == 12
    assert r.response == pb.ResponseOptions(
        return_output_logprobs=True,
        output_candidates=pb.CandidateTokenSelection(top_n=2),
        return_prompt_logprobs=True,
    )
    assert r.guided == pb.GuidedDecoding(json_schema='{"type": "object"}', backend="xgrammar")
    assert mapped.metadata == {
        "openengine-target-dp-rank": "1",
        "openengine-priority": "5",
        "traceparent": "00-ab-cd-01",
    }


def test_dp_rank_outside_this_worker_is_not_forwarded() -> None:
    mapped = to_generate_request(dynamo_request(routing={"dp_rank": 3}), mock_card())
    assert mapped.metadata == {}


@pytest.mark.parametrize(
    "bad",
    [
        {"token_ids": "nope"},
        {"token_ids": [1, -2]},
        {"stop_conditions": {"max_tokens": -1}},
        {"sampling_options": {"temperature": "hot"}},
        {"stop_conditions": {"stop": [3]}},
        {"model": 5},
    ],
)
def test_malformed_requests_are_rejected_invalid_argument(bad: dict[str, Any]) -> None:
    with pytest.raises(Rejection) as err:
        to_generate_request(dynamo_request(**bad), mock_card())
    assert err.value.code == pb.ErrorCode.INVALID_ARGUMENT


def test_decode_request_carries_the_prefill_session_bytes_verbatim() -> None:
    card = mock_card(role="decode")
    session = pb.KvSessionRef(
        session_id="s1",
        transfer_backend=card.kv_connector.transfer_backend,  # type: ignore[union-attr]
        handoff_profile=card.kv_connector.handoff_profile,  # type: ignore[union-attr]
        dp_rank=0,
    )
    raw = bytes(session) + b"\xa8\x06\x01"  # an unknown field (100: varint 1) a newer engine might add
    params = {"disaggregated_params": {KV_SESSION_KEY: base64.b64encode(raw).decode()}}
    mapped = to_generate_request(dynamo_request(prefill_result=params, routing={"dp_rank": 0}), card)
    assert mapped.request.kv is not None and mapped.request.kv.session is not None
    assert mapped.request.kv.session.session_id == "s1"
    assert "openengine-target-dp-rank" not in mapped.metadata  # the session's rank is authoritative
    admitted = admit(mapped.request, mapped.metadata, card).request
    sent = bytes(splice_kv_session(admitted, mapped.kv_session_bytes))
    assert raw in sent  # forwarded byte for byte, unknown field included


def test_decode_request_with_garbage_session_is_rejected() -> None:
    params = {"disaggregated_params": {KV_SESSION_KEY: base64.b64encode(b"\xff\xff").decode()}}
    with pytest.raises(Rejection) as err:
        to_generate_request(dynamo_request(prefill_result=params), mock_card(role="decode"))
    assert err.value.code == pb.ErrorCode.INVALID_ARGUMENT


def test_bootstrap_info_becomes_the_client_bootstrap_session() -> None:
    card = mock_card(role="prefill", flavor="sglang")
    boot = {"bootstrap_host": "127.0.0.1", "bootstrap_port": 7000, "bootstrap_room": 42}
    mapped = to_generate_request(dynamo_request(bootstrap_info=boot), card)
    session = mapped.request.kv.session  # type: ignore[union-attr]
    assert session is not None and session.bootstrap is not None
    assert session.bootstrap.room_id == 42 and session.bootstrap.endpoint == pb.KvEndpoint(
        host="127.0.0.1", port=7000
    )
    assert session.handoff_profile == card.kv_connector.handoff_profile  # type: ignore[union-attr]
    admit(mapped.request, mapped.metadata, card)


def _token(index: int, ids: list[int], logprob: float | None = None) -> pb.GenerateResponse:
    tokens = [
        pb.TokenInfo(
            token_id=t,
            logprob=logprob,
            candidates=[pb.LogProb(token_id=t, logprob=logprob or 0.0, token="x", rank=1)] if logprob else [],
        )
        for t in ids
    ]
    return pb.GenerateResponse(request_id="r", token=pb.TokenOutput(output_index=index, tokens=tokens))


def test_events_to_chunks() -> None:
    assert chunk_of(_token(0, [5, 6])) == {"token_ids": [5, 6], "index": 0}
    assert chunk_of(_token(1, [7], logprob=-0.5)) == {
        "token_ids": [7],
        "index": 1,
        "log_probs": [-0.5],
        "top_logprobs": [[{"rank": 1, "token_id": 7, "token": "x", "logprob": -0.5}]],
    }
    fin = pb.GenerateResponse(
        request_id="r",
        finished=pb.GenerationFinished(output_index=0, reason=pb.FinishReason.LENGTH),
        usage=pb.Usage(prompt_tokens=3, completion_tokens=4, total_tokens=7, cached_prompt_tokens=2),
    )
    assert chunk_of(fin) == {
        "token_ids": [],
        "index": 0,
        "finish_reason": "length",
        "completion_usage": {
            "prompt_tokens": 3,
            "completion_tokens": 4,
            "total_tokens": 7,
            "prompt_tokens_details": {"cached_tokens": 2},
        },
    }
    ready = pb.GenerateResponse(
        request_id="r", prefill_ready=pb.PrefillReady(kv_session=pb.KvSessionRef(session_id="s"))
    )
    chunk = chunk_of(ready, b"\x0a\x01s\xa8\x06\x01")  # the engine's bytes (StreamHandle.kv_session_bytes)
    assert chunk is not None
    assert base64.b64decode(chunk["disaggregated_params"][KV_SESSION_KEY]) == b"\x0a\x01s\xa8\x06\x01"
    err = pb.GenerateResponse(request_id="r", error=pb.EngineError(code=pb.ErrorCode.INTERNAL))
    assert chunk_of(err) is None


def test_merger_folds_tokens_and_the_finish_of_one_output() -> None:
    a = chunk_of(_token(0, [1]))
    assert a is not None
    assert ChunkMerger.merge(a, chunk_of(_token(0, [2])))  # type: ignore[arg-type]
    assert not ChunkMerger.merge(a, chunk_of(_token(1, [3])))  # type: ignore[arg-type]
    assert not ChunkMerger.merge(a, chunk_of(_token(0, [4], logprob=-1.0)))  # type: ignore[arg-type]
    fin = {"token_ids": [], "index": 0, "finish_reason": "stop", "completion_usage": {"total_tokens": 2}}
    assert ChunkMerger.merge(a, fin)
    assert a == {
        "token_ids": [1, 2],
        "index": 0,
        "finish_reason": "stop",
        "completion_usage": {"total_tokens": 2},
    }
    assert not ChunkMerger.merge(a, {"token_ids": [9], "index": 0})  # nothing after a finish


def test_error_kinds() -> None:
    code = pb.ErrorCode
    assert error_kind(Outcome("completed"), dynamo_cancelled=False) is None
    cancelled = Outcome(CANCELLED, code.CANCELLED, "x")
    assert error_kind(cancelled, dynamo_cancelled=True) is None
    assert error_kind(cancelled, dynamo_cancelled=False) == "Cancelled"
    assert error_kind(Outcome(REJECTED, code.INVALID_ARGUMENT), dynamo_cancelled=False) == "InvalidArgument"
    assert error_kind(Outcome(REJECTED, code.MODEL_NOT_FOUND), dynamo_cancelled=False) == "InvalidArgument"
    assert error_kind(Outcome(REJECTED, code.DRAINING, "", True), dynamo_cancelled=False) == "EngineShutdown"
    assert error_kind(Outcome(CANCELLED, code.DRAINING, "", True), dynamo_cancelled=False) == "EngineShutdown"
    assert error_kind(Outcome(FAILED, code.INTERNAL, "", True), dynamo_cancelled=False) == "Disconnected"
    assert error_kind(Outcome(FAILED, code.INTERNAL, "", False), dynamo_cancelled=False) == "Unknown"
