"""The sidecar's spans on the OpenTelemetry SDK (imported only when tracing is on).

:func:`build_tracer` makes a :class:`Tracer`: the SDK's ``TracerProvider`` (its sampler, resource
and limits from the ``OTEL_*`` variables; ``service.name`` defaults to ``openengine-sidecar``),
the OTLP/HTTP exporter, and the SDK's ``BatchSpanProcessor`` behind :class:`_BoundedProcessor`,
which keeps at most ``max_queue`` finished spans waiting and counts what it drops
(``openengine_sidecar_trace_spans_total``). Nothing here touches the network on the calling
thread: spans are handed to the processor's queue, and its own thread exports them.

The sidecar's span vocabulary, in one place:

- :meth:`Tracer.start_stream`: one ``generate`` span (kind SERVER) per admitted stream, the
  child of the client's ``traceparent`` when it sent one; a :class:`StreamTrace` carries it.
- :meth:`StreamTrace.abort_call`: one ``Abort`` span (kind CLIENT) per Abort call sent for the
  stream, a child of its span, whether the stream has ended or not (retries, re-deliveries and
  confirmations come later).
- :meth:`Tracer.refused`: a ``generate`` span ended at once, for a request refused at admission.
- :meth:`Tracer.begin`: a root span of its own (the KV bridge's gaps, replays and resyncs).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence

from opentelemetry import trace as trace_api
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue as AttributeValue

from sidecar import __version__
from sidecar.tracing import TRACE_SPANS, TracingConfig

log = logging.getLogger(__name__)

#: A span's attributes (``AttributeValue`` is re-exported for the code that builds them).
Attributes = Mapping[str, AttributeValue]

_PROPAGATOR = TraceContextTextMapPropagator()


class _CountingExporter(SpanExporter):
    """The OTLP exporter, counting what it exported or failed to, and telling the processor
    which spans have left its queue. A failing collector is logged once (and once more when it
    works again), not at every batch: the exporter's own log stays quiet below CRITICAL."""

    def __init__(self, inner: SpanExporter, processor: _BoundedProcessor, where: str) -> None:
        self._inner = inner
        self._processor = processor
        self._where = where
        self._failing = False

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self._processor.left_queue(len(spans))
        try:
            result = self._inner.export(spans)
        except Exception as err:  # the SDK's thread would log it; counted and said once here
            result = SpanExportResult.FAILURE
            log.debug("trace export raised %r", err)
        ok = result is SpanExportResult.SUCCESS
        TRACE_SPANS.labels("exported" if ok else "export_failed").inc(len(spans))
        if ok and self._failing:
            log.info("trace export to %s works again", self._where)
        elif not ok and not self._failing:
            log.warning(
                "trace export to %s failing (no answer, or refused): spans are dropped until the"
                " collector takes them (counted in openengine_sidecar_trace_spans_total)",
                self._where,
            )
        self._failing = not ok
        return result

    def shutdown(self) -> None:
        self._inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._inner.force_flush(timeout_millis)


class _BoundedProcessor(SpanProcessor):
    """The SDK's ``BatchSpanProcessor`` behind a count of the spans it holds: a span that would
    make more than ``max_queue`` is dropped here and counted (``queue_full``), so the batch
    processor's own queue never overflows (it would drop silently). The count goes down as
    the exporter takes each batch (:meth:`left_queue`)."""

    def __init__(self, exporter: SpanExporter, max_queue: int, where: str) -> None:
        self._max = max_queue
        self._held = 0
        self._lock = threading.Lock()
        self._batch = BatchSpanProcessor(
            _CountingExporter(exporter, self, where),
            max_queue_size=max_queue,
            max_export_batch_size=min(512, max_queue),
        )

    def on_end(self, span: ReadableSpan) -> None:
        if span.context is None or not span.context.trace_flags.sampled:
            return
        with self._lock:
            if self._held >= self._max:
                full = True
            else:
                full = False
                self._held += 1
        if full:
            TRACE_SPANS.labels("queue_full").inc()
            return
        self._batch.on_end(span)

    def left_queue(self, count: int) -> None:
        with self._lock:
            self._held -= count

    def shutdown(self) -> None:
        self._batch.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._batch.force_flush(timeout_millis)


def build_tracer(config: TracingConfig, exporter: SpanExporter | None = None) -> Tracer:
    """The sidecar's :class:`Tracer` for ``config`` (``exporter``: instead of OTLP/HTTP, for tests)."""
    resource = Resource.create()  # OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: "openengine-sidecar"}))
    provider = TracerProvider(resource=resource, shutdown_on_exit=False)
    if exporter is None:
        exporter = OTLPSpanExporter(endpoint=config.traces_url)
        logging.getLogger("opentelemetry.exporter").setLevel(logging.CRITICAL)  # _CountingExporter says it
    where = config.traces_url or "the OTEL_EXPORTER_OTLP_* endpoint"
    provider.add_span_processor(_BoundedProcessor(exporter, config.max_queue, where))
    return Tracer(provider)


def _parent(traceparent: str | None, tracestate: str | None) -> trace_api.Context | None:
    if traceparent is None:
        return None
    carrier = {"traceparent": traceparent}
    if tracestate is not None:
        carrier["tracestate"] = tracestate
    return _PROPAGATOR.extract(carrier)


class Tracer:
    """Makes the sidecar's spans (module doc). Methods are cheap and never block: spans are
    queued for the exporter's thread. :meth:`shutdown` (blocking) sends what is left."""

    def __init__(self, provider: TracerProvider) -> None:
        self._provider = provider
        self._tracer = provider.get_tracer("openengine-sidecar", __version__)

    def start_stream(
        self,
        *,
        traceparent: str | None,
        tracestate: str | None,
        start_ns: int,
        attributes: Attributes,
    ) -> StreamTrace:
        """A stream's ``generate`` span, started at ``start_ns`` (``time.time_ns()``)."""
        span = self._tracer.start_span(
            "generate",
            context=_parent(traceparent, tracestate),
            kind=SpanKind.SERVER,
            attributes=attributes,
            start_time=start_ns,
        )
        return StreamTrace(self._tracer, span)

    def refused(
        self,
        *,
        traceparent: str | None,
        tracestate: str | None,
        start_ns: int,
        attributes: Attributes,
        code: str,
        message: str,
    ) -> None:
        """A ``generate`` span for a request refused before the engine: event ``refused`` (its
        code and message), status ERROR, ended now."""
        span = self._tracer.start_span(
            "generate",
            context=_parent(traceparent, tracestate),
            kind=SpanKind.SERVER,
            attributes=attributes,
            start_time=start_ns,
        )
        span.add_event("refused", {"openengine.error_code": code, "openengine.message": message})
        span.set_status(Status(StatusCode.ERROR, message))
        span.end()

    def begin(self, name: str, attributes: Attributes) -> Activity:
        """A root span of its own (INTERNAL), ended by :meth:`Activity.end`."""
        return Activity(self._tracer.start_span(name, attributes=attributes))

    def shutdown(self) -> None:
        """Export what is queued and stop (blocks: call it in a thread, bounded)."""
        self._provider.shutdown()


class Activity:
    """A span of its own (:meth:`Tracer.begin`): attributes and events, then :meth:`end`."""

    __slots__ = ("_span",)

    def __init__(self, span: trace_api.Span) -> None:
        self._span = span

    def set(self, key: str, value: AttributeValue) -> None:
        self._span.set_attribute(key, value)

    def event(self, name: str, attributes: Attributes | None = None) -> None:
        self._span.add_event(name, attributes)

    def end(self, error: str | None = None) -> None:
        """End the span; ``error``: it failed, and why (status ERROR)."""
        if error is not None:
            self._span.set_status(Status(StatusCode.ERROR, error))
        self._span.end()


class StreamTrace:
    """One stream's ``generate`` span: events while it is open, then :meth:`end` once; Abort
    spans (:meth:`abort_call`) may follow after it ended."""

    __slots__ = ("_open", "_span", "_tracer")

    def __init__(self, tracer: trace_api.Tracer, span: trace_api.Span) -> None:
        self._tracer = tracer
        self._span = span
        self._open = True

    @property
    def traceparent(self) -> str:
        """The W3C ``traceparent`` of this span (what the engine gets: its spans nest under it)."""
        ctx = self._span.get_span_context()
        return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags) & 0xFF:02x}"

    def event(self, name: str, attributes: Attributes | None = None) -> None:
        """An event on the span while it is open (later ones are left out)."""
        if self._open:
            self._span.add_event(name, attributes)

    def abort_call(self, state: str) -> AbortCall:
        """An ``Abort`` span for one Abort call, starting now (``state``: where the Abort stands,
        ``sidecar.core.abort_ledger.AbortState``); event ``abort.sent`` on the stream's span."""
        span = self._tracer.start_span(
            "Abort",
            context=trace_api.set_span_in_context(self._span),
            kind=SpanKind.CLIENT,
            attributes={"openengine.abort.state": state},
        )
        self.event("abort.sent", {"openengine.abort.state": state})
        return AbortCall(self, span)

    def end(self, attributes: Attributes, error: str | None) -> None:
        """The final attributes, event ``end``; status ERROR with ``error`` when the stream failed."""
        if not self._open:
            return
        self._open = False
        span = self._span
        span.set_attributes(attributes)
        span.add_event("end")
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end()


class AbortCall:
    """One Abort call's span (:meth:`StreamTrace.abort_call`), ended by :meth:`answered`."""

    __slots__ = ("_span", "_stream")

    def __init__(self, stream: StreamTrace, span: trace_api.Span) -> None:
        self._stream = stream
        self._span = span

    def answered(self, result: str) -> None:
        """End the call with its result (``aborted``, ``already_finished``, ``not_found``,
        ``failed``, ``refused``: a retryable status, ``no_answer``); event ``abort.answered`` on
        the stream's span while it is open."""
        self._span.set_attribute("openengine.abort.result", result)
        if result in ("failed", "refused", "no_answer"):
            self._span.set_status(Status(StatusCode.ERROR, result))
        self._span.end()
        self._stream.event("abort.answered", {"openengine.abort.result": result})
