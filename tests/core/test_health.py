"""``health`` call semantics (sidecar.core.health): one engineState vocabulary; HealthRequest
params checked against the card, then forwarded to the engine as given."""

from __future__ import annotations

from typing import Any

import pytest

from sidecar.core.errors import Rejection
from sidecar.core.health import ENGINE_STATES, HealthStatus, ask_engine, state_name
from sidecar.openengine import pb
from tests.fake_engine import FakeEngine

from .shapes import vllm_card

LOCAL = HealthStatus(ready=True, reason=None, draining=False, engine_state="ready", active_streams=0)


def engine_answering(answer: pb.HealthResponse) -> FakeEngine:
    engine = FakeEngine()

    async def health() -> pb.HealthResponse:
        return answer

    engine.health_script = health
    return engine


def test_engine_state_vocabulary() -> None:
    names = {state_name(s) for s in pb.HealthState}
    assert names == {"unspecified", "starting", "ready", "degraded", "draining", "not_ready"}
    assert names | {"unknown", "unreachable"} == set(ENGINE_STATES)
    assert state_name(99) == "unspecified"  # a state this build does not know


async def test_model_is_resolved_before_the_engine_and_forwarded_as_served_name() -> None:
    card = vllm_card()
    served = card.models[0].served_model_name
    alias = card.models[0].aliases[0]
    engine = engine_answering(pb.HealthResponse(state=pb.HealthState.READY))
    request = pb.HealthRequest(include_inference_probe=True, model=alias, role=pb.EngineRole.AGGREGATED)
    out = await ask_engine(engine, card, request, LOCAL, 5.0)  # type: ignore[arg-type]
    assert engine.health_requests == [
        pb.HealthRequest(include_inference_probe=True, model=served, role=pb.EngineRole.AGGREGATED)
    ]
    assert out.ready and out.engine is not None and out.engine.state == "ready"
    for name in ("no-such-model", "sql-lora"):  # unknown; a LoRA adapter is no model to probe
        with pytest.raises(Rejection) as info:
            await ask_engine(engine, card, pb.HealthRequest(model=name), LOCAL, 5.0)  # type: ignore[arg-type]
        assert info.value.code == pb.ErrorCode.MODEL_NOT_FOUND
    assert len(engine.health_requests) == 1  # refused before the engine


@pytest.mark.parametrize(
    ("local", "answer", "ready", "reason"),
    [
        (LOCAL, pb.HealthState.DEGRADED, True, None),
        (LOCAL, pb.HealthState.NOT_READY, False, "engine health is not_ready (model: warming up)"),
        (
            HealthStatus(
                ready=False, reason="draining", draining=True, engine_state="ready", active_streams=2
            ),
            pb.HealthState.READY,
            False,
            "draining",
        ),
    ],
)
async def test_engine_answer_folded_into_readiness(local: Any, answer: Any, ready: bool, reason: Any) -> None:
    engine = engine_answering(
        pb.HealthResponse(
            state=answer,
            checks=[
                pb.HealthCheck(name="grpc", state=pb.HealthState.READY),
                pb.HealthCheck(name="model", state=answer, message="warming up"),
            ],
        )
    )
    out = await ask_engine(engine, vllm_card(), pb.HealthRequest(include_inference_probe=True), local, 5.0)  # type: ignore[arg-type]
    assert (out.ready, out.reason, out.engine_state) == (ready, reason, state_name(answer))
    assert out.engine is not None and [c.name for c in out.engine.checks] == ["grpc", "model"]
