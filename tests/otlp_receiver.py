"""A small OTLP/HTTP trace receiver for the tests: what a collector would get, decoded.

It listens on 127.0.0.1 (an ephemeral port) in a thread, takes ``POST /v1/traces`` bodies
(protobuf, gzip or not), decodes them with the OpenTelemetry protocol's own types
(``opentelemetry-proto``: ``ExportTraceServiceRequest``) and keeps every span as a
:class:`Span`. ``hold()`` makes it stop answering until released (a collector that hangs);
``status`` makes it refuse (a collector that fails).
"""

from __future__ import annotations

import gzip
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span as PbSpan
from opentelemetry.proto.trace.v1.trace_pb2 import Status as PbStatus

#: ``Span.kind`` names of the protocol (``SPAN_KIND_SERVER`` -> ``server``).
KINDS = {v: k.removeprefix("SPAN_KIND_").lower() for k, v in PbSpan.SpanKind.items()}
#: ``Status.code`` names (``STATUS_CODE_ERROR`` -> ``error``).
STATUSES = {v: k.removeprefix("STATUS_CODE_").lower() for k, v in PbStatus.StatusCode.items()}


def _value(v: AnyValue) -> Any:
    which = v.WhichOneof("value")
    if which == "array_value":
        return [_value(x) for x in v.array_value.values]
    if which == "kvlist_value":
        return _attrs(v.kvlist_value.values)
    return getattr(v, which) if which else None


def _attrs(kvs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs if isinstance(kv, KeyValue)}


@dataclass
class Span:
    """One received span; ids as lower-case hex, times in ns."""

    name: str
    trace_id: str
    span_id: str
    parent_id: str
    kind: str
    attributes: dict[str, Any]
    events: list[tuple[str, dict[str, Any]]]
    status: str
    start: int
    end: int
    resource: dict[str, Any] = field(default_factory=dict)

    def event_names(self) -> list[str]:
        return [name for name, _ in self.events]

    def event(self, name: str) -> dict[str, Any]:
        [attrs] = [a for n, a in self.events if n == name]
        return attrs


class Receiver:
    """What the receiver got (thread-safe reads); ``url`` is the collector's base URL."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.requests = 0
        #: Requests taken but not answered yet (held by :meth:`hold`).
        self.requests_waiting = 0
        self.status = 200
        self._spans: list[Span] = []
        self._lock = threading.Lock()
        self._open = threading.Event()
        self._open.set()

    def spans(self, name: str | None = None) -> list[Span]:
        with self._lock:
            return [s for s in self._spans if name is None or s.name == name]

    def trace(self, trace_id: str) -> list[Span]:
        return [s for s in self.spans() if s.trace_id == trace_id]

    def children(self, parent: Span) -> list[Span]:
        return [s for s in self.spans() if s.parent_id == parent.span_id]

    @contextmanager
    def hold(self) -> Iterator[None]:
        """Answer no export until the block is left (requests wait, unanswered)."""
        self._open.clear()
        try:
            yield
        finally:
            self._open.set()

    def _take(self, body: bytes) -> int:
        with self._lock:
            self.requests_waiting += 1
        self._open.wait(30)
        with self._lock:
            self.requests_waiting -= 1
        request = ExportTraceServiceRequest.FromString(body)
        got: list[Span] = []
        for rs in request.resource_spans:
            resource = _attrs(rs.resource.attributes)
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(
                        Span(
                            name=s.name,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_id=s.parent_span_id.hex(),
                            kind=KINDS[s.kind],
                            attributes=_attrs(s.attributes),
                            events=[(e.name, _attrs(e.attributes)) for e in s.events],
                            status=STATUSES[s.status.code],
                            start=s.start_time_unix_nano,
                            end=s.end_time_unix_nano,
                            resource=resource,
                        )
                    )
        with self._lock:
            self.requests += 1
            if self.status == 200:
                self._spans.extend(got)
            return self.status


@contextmanager
def otlp_receiver() -> Iterator[Receiver]:
    """A running receiver for the ``with`` block (then shut down)."""
    receiver: Receiver

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            if self.path != "/v1/traces":
                self.send_error(404)
                return
            status = receiver._take(body)
            answer = ExportTraceServiceResponse().SerializeToString()
            self.send_response(status)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    receiver = Receiver(f"http://127.0.0.1:{server.server_address[1]}")
    thread = threading.Thread(target=server.serve_forever, name="otlp-receiver", daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        receiver._open.set()
        server.shutdown()
        server.server_close()
        thread.join(5)


def main() -> None:
    """``python -m tests.otlp_receiver``: serve until interrupted, printing the collector URL
    (a collector to point ``--otlp-endpoint`` at when measuring tracing's cost)."""
    import time

    with otlp_receiver() as receiver:
        print(receiver.url, flush=True)
        try:
            while True:
                time.sleep(60)
                print(f"{receiver.requests} requests, {len(receiver.spans())} spans", flush=True)
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
