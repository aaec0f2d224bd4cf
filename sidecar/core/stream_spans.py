"""What a stream's span says: its attributes, its refusal, its end (``sidecar.tracing``).

Only called with tracing on (a :class:`~sidecar.tracing.otel.Tracer` given to the
:class:`~sidecar.core.sidecar.Sidecar`): :meth:`Sidecar.admit` calls :func:`admitted` or
:func:`refused`, :meth:`StreamSupervisor.run` calls :func:`ended`; the events in between (the
first token, a cancel, each Abort call) are recorded by the lifecycle itself through
``StreamHandle.trace``. Whatever plane a stream came from (WebSocket, Dynamo, OpenAI), its span
is made here, continuing the ``traceparent`` the client sent (validated by admission).

Attributes: ``gen_ai.request.model``, ``gen_ai.usage.input_tokens`` (the engine's count, from the
last event's usage), ``gen_ai.usage.output_tokens`` (tokens relayed); ``openengine.request_id``,
``openengine.role``, ``openengine.dp_rank`` (when the client targeted one), ``openengine.lora``,
``openengine.outcome`` and ``openengine.error_code``, ``openengine.kv_session`` (a prefill
handed its KV session over).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from sidecar.core.errors import Rejection, error_code_name
from sidecar.core.metadata import TRACEPARENT, TRACESTATE, valid_traceparent, valid_tracestate

if TYPE_CHECKING:
    from sidecar.core.admission import Admitted
    from sidecar.core.lifecycle import Outcome, StreamHandle
    from sidecar.openengine import pb
    from sidecar.tracing.otel import AttributeValue, Tracer


def admitted(tracer: Tracer, handle: StreamHandle, admission: Admitted, role: str, start_ns: int) -> None:
    """Start ``handle``'s span (from ``start_ns``) with event ``admitted``, and send the engine
    the span's ``traceparent`` in place of the client's (its ``tracestate`` goes on unchanged)."""
    meta = admission.metadata
    attributes: dict[str, AttributeValue] = {
        "gen_ai.request.model": admission.model.served_model_name,
        "openengine.request_id": handle.request_id,
        "openengine.role": role,
    }
    if meta.target_dp_rank is not None:
        attributes["openengine.dp_rank"] = meta.target_dp_rank
    if admission.lora is not None:
        attributes["openengine.lora"] = admission.lora.lora_name
    trace = tracer.start_stream(
        traceparent=meta.traceparent, tracestate=meta.tracestate, start_ns=start_ns, attributes=attributes
    )
    trace.event("admitted")
    handle.trace = trace
    pairs = [(k, v) for k, v in handle.metadata if k != TRACEPARENT]
    pairs.append((TRACEPARENT, trace.traceparent))
    handle.metadata = pairs


def refused(
    tracer: Tracer,
    request: pb.GenerateRequest,
    metadata: Mapping[str, str],
    rejection: Rejection,
    role: str | None,
    start_ns: int,
) -> None:
    """A span for a request refused at admission (a drain refusal among them): the client's
    trace context only when well-formed (it may be why the request was refused)."""
    traceparent = metadata.get(TRACEPARENT)
    tracestate = metadata.get(TRACESTATE)
    if not isinstance(traceparent, str) or not valid_traceparent(traceparent):
        traceparent = tracestate = None
    elif not isinstance(tracestate, str) or not valid_tracestate(tracestate):
        tracestate = None
    attributes: dict[str, AttributeValue] = {
        "gen_ai.request.model": request.model,
        "openengine.outcome": "rejected",
        "openengine.error_code": error_code_name(rejection.code),
    }
    if request.request_id:
        attributes["openengine.request_id"] = request.request_id
    if role is not None:
        attributes["openengine.role"] = role
    tracer.refused(
        traceparent=traceparent,
        tracestate=tracestate,
        start_ns=start_ns,
        attributes=attributes,
        code=error_code_name(rejection.code),
        message=rejection.message,
    )


def ended(handle: StreamHandle, outcome: Outcome | None) -> None:
    """End ``handle``'s span with its outcome (None: the stream was cut off by the sidecar's
    own stop before it had one) and its token counts."""
    trace = handle.trace
    if trace is None:
        return
    attributes: dict[str, AttributeValue] = {"gen_ai.usage.output_tokens": handle.tokens_out}
    if handle.usage is not None:
        attributes["gen_ai.usage.input_tokens"] = handle.usage.prompt_tokens
    if handle.kv_session_bytes is not None:
        attributes["openengine.kv_session"] = True
    error: str | None = None
    if outcome is None:
        attributes["openengine.outcome"] = "cancelled"
    else:
        attributes["openengine.outcome"] = outcome.kind
        if outcome.code is not None:
            attributes["openengine.error_code"] = error_code_name(outcome.code)
        if outcome.kind in ("failed", "rejected"):
            error = outcome.message or outcome.kind
    trace.end(attributes, error)
