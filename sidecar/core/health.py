"""The ``health`` call's answer and the ``engineState`` vocabulary (docs/PROTOCOL.md).

``health`` with empty params answers from what the sidecar already knows (its last ``Health``
check of the engine, every ``--health-interval``); with any ``HealthRequest`` field set it
forwards that request to the engine (:func:`ask_engine`) and adds the engine's answer -- the
params are honoured or refused, never validated and then ignored.

``engineState`` is one vocabulary, the short lower-case names the worker card uses for enums:
the engine's ``HealthState`` (``starting``, ``ready``, ``degraded``, ``draining``,
``not_ready``; ``unspecified`` for 0 or a state this build does not know) plus two of the
sidecar's own: ``unknown`` (not asked yet) and ``unreachable`` (the last check failed).
"""

from __future__ import annotations

from typing import Final, Literal

import msgspec
import trio

from sidecar.core.card import WorkerCard, enum_name
from sidecar.core.errors import Rejection
from sidecar.openengine import pb
from sidecar.openengine.client import EngineClient
from sidecar.openengine.engine_errors import EngineClientError

__all__ = [
    "ENGINE_STATES",
    "SERVING_HEALTH",
    "EngineCheck",
    "EngineHealth",
    "EngineState",
    "HealthStatus",
    "ask_engine",
    "state_name",
]

EngineState = Literal[
    "unknown", "unreachable", "unspecified", "starting", "ready", "degraded", "draining", "not_ready"
]
#: Every ``engineState`` value.
ENGINE_STATES: Final[tuple[str, ...]] = EngineState.__args__  # type: ignore[attr-defined]
#: Engine health states in which the sidecar serves.
SERVING_HEALTH: Final = frozenset({pb.HealthState.READY, pb.HealthState.DEGRADED})


def state_name(state: int) -> EngineState:
    """``engineState`` of an engine ``HealthState`` (``unspecified`` for 0 or an unknown value)."""
    return enum_name(pb.HealthState, state) or "unspecified"  # type: ignore[return-value]


class EngineCheck(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One ``HealthCheck`` the engine reported (``grpc``, ``scheduler``, ``model``,
    ``kv_connector``, ``role``, ``inference_probe``, ...)."""

    name: str
    state: EngineState
    message: str = ""


class EngineHealth(msgspec.Struct, kw_only=True):
    """The engine's answer to the forwarded ``HealthRequest``."""

    state: EngineState
    checks: list[EngineCheck]


class HealthStatus(msgspec.Struct, kw_only=True, rename="camel", omit_defaults=True):
    """Body of a successful ``health`` result."""

    #: The sidecar serves new work (``GET /ready`` would be 200); with ``engine``, the engine's
    #: answer must also be ``ready`` or ``degraded``.
    ready: bool
    #: Why not ready (``None`` when ready).
    reason: str | None
    draining: bool
    #: The engine's state: from ``engine`` when the engine was asked, else from the last check.
    engine_state: EngineState
    #: Streams in flight on this sidecar.
    active_streams: int
    #: Present only when the params asked the engine (any ``HealthRequest`` field set).
    engine: EngineHealth | None = None


async def ask_engine(
    engine: EngineClient,
    card: WorkerCard | None,
    request: pb.HealthRequest,
    local: HealthStatus,
    timeout: float,
) -> HealthStatus:
    """Forward ``request`` to the engine and fold its answer into ``local``.

    ``model`` must be a served name or alias of this worker (``MODEL_NOT_FOUND`` otherwise; a
    LoRA adapter is not a model the engine can probe) and is forwarded as the served name;
    ``role`` and ``includeInferenceProbe`` are forwarded as given. An engine that fails or
    does not answer within ``timeout`` is a retryable ``INTERNAL`` rejection.
    """
    forward = pb.HealthRequest(include_inference_probe=request.include_inference_probe, role=request.role)
    if request.model:
        if card is None:
            raise Rejection(pb.ErrorCode.INTERNAL, "engine not discovered yet", True)
        resolved = card.resolve(request.model)
        if resolved is None or resolved.lora is not None:
            raise Rejection(
                pb.ErrorCode.MODEL_NOT_FOUND,
                f"model {request.model[:200]!r} is not a served model name or alias of this worker",
            )
        forward.model = resolved.model.served_model_name
    with trio.move_on_after(timeout):
        try:
            answer = await engine.health(forward)
        except EngineClientError as err:
            raise Rejection(pb.ErrorCode.INTERNAL, f"engine health check failed: {err}", True) from None
        state = state_name(answer.state)
        checks = [
            EngineCheck(name=c.name, state=state_name(c.state), message=c.message) for c in answer.checks
        ]
        ready = local.ready and answer.state in SERVING_HEALTH
        reason = local.reason
        if reason is None and not ready:
            failing = next((c for c in checks if c.state not in ("ready", "degraded")), None)
            reason = f"engine health is {state}" + (
                f" ({failing.name}: {failing.message or failing.state})" if failing else ""
            )
        return msgspec.structs.replace(
            local,
            ready=ready,
            reason=reason,
            engine_state=state,
            engine=EngineHealth(state=state, checks=checks),
        )
    raise Rejection(pb.ErrorCode.INTERNAL, "health: engine did not answer in time", True)
