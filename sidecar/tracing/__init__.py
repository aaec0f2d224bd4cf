"""OpenTelemetry traces of the sidecar: opt-in, and nothing imported or done while off.

Tracing is on when ``run --otlp-endpoint URL`` is given or OpenTelemetry's own variables name a
collector (``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_ENDPOINT``), unless
``OTEL_SDK_DISABLED=true`` or ``OTEL_TRACES_EXPORTER=none``. :func:`tracing_config` decides that
at parse time (a bad URL, another OTLP protocol than ``http/protobuf`` or a bad queue size is a
one-line usage error); :func:`open_tracer` then imports the OpenTelemetry SDK and the OTLP/HTTP
exporter (:mod:`sidecar.tracing.otel`) — only then, so a sidecar without tracing never loads
them, and its code paths hold ``None`` where a tracer or a stream's trace would be.

Spans leave through a bounded queue drained by the SDK's export thread: a slow or dead
collector never holds a stream up; what does not fit is dropped and counted
(:data:`TRACE_SPANS`). The other ``OTEL_*`` variables keep their usual meaning (service name
and resource attributes, headers, timeout, compression, TLS files, sampler, batch delay).
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import trio
from prometheus_client import Counter

from sidecar.metrics_registry import REGISTRY

if TYPE_CHECKING:
    from sidecar.tracing.otel import Tracer

__all__ = ["TRACE_SPANS", "TracingConfig", "TracingConfigError", "open_tracer", "tracing_config"]

TRACE_SPANS = Counter(
    "openengine_sidecar_trace_spans",
    "Finished trace spans by result: exported, queue_full (dropped: the export queue was full),"
    " export_failed (the collector refused them or could not be reached).",
    ["result"],
    registry=REGISTRY,
)

#: Spans waiting for export at most (``OTEL_BSP_MAX_QUEUE_SIZE`` overrides it).
DEFAULT_MAX_QUEUE = 2048
#: The OTLP/HTTP path of traces under a collector's base URL.
TRACES_PATH = "/v1/traces"
#: Seconds the exit waits for the last spans to leave.
SHUTDOWN_TIMEOUT = 2.0


class TracingConfigError(ValueError):
    """Unusable tracing settings (``str(err)`` is the one-line reason)."""


@dataclass(frozen=True)
class TracingConfig:
    """Where spans go. ``traces_url``: the full OTLP/HTTP traces URL (from ``--otlp-endpoint``),
    or None: the exporter reads ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` / ``_ENDPOINT`` itself.
    ``max_queue``: finished spans held for export at most; past it they are dropped (counted)."""

    traces_url: str | None = None
    max_queue: int = DEFAULT_MAX_QUEUE


def _check_url(value: str, name: str) -> None:
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise TracingConfigError(f"{name} must be an http:// or https:// URL, got {value!r}")


def tracing_config(endpoint: str | None, env: Mapping[str, str] | None = None) -> TracingConfig | None:
    """The tracing settings of ``run`` (``endpoint``: ``--otlp-endpoint``; ``env``: the process
    environment unless given), or None when tracing is off (module doc). Raises
    :class:`TracingConfigError`."""
    env = os.environ if env is None else env
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    exporter = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter == "none":
        return None
    traces_env = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
    base_env = env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
    if endpoint is None and not traces_env and not base_env:
        return None
    if exporter not in ("", "otlp"):
        raise TracingConfigError(f"OTEL_TRACES_EXPORTER={exporter} is not supported (otlp or none)")
    protocol = (
        env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or ""
    ).strip()
    if protocol not in ("", "http/protobuf"):
        raise TracingConfigError(
            f"OTLP protocol {protocol!r} is not supported: traces go over http/protobuf"
            " (a collector's OTLP/HTTP port, 4318 by default)"
        )
    raw_queue = env.get("OTEL_BSP_MAX_QUEUE_SIZE", "").strip()
    max_queue = DEFAULT_MAX_QUEUE
    if raw_queue:
        if not raw_queue.isdigit() or not 0 < int(raw_queue) <= 1_000_000:
            raise TracingConfigError(f"OTEL_BSP_MAX_QUEUE_SIZE must be 1 to 1000000, got {raw_queue!r}")
        max_queue = int(raw_queue)
    if endpoint is not None:
        _check_url(endpoint, "--otlp-endpoint")
        url = endpoint.rstrip("/")
        if not url.endswith(TRACES_PATH):
            url += TRACES_PATH
        return TracingConfig(url, max_queue)
    _check_url(
        traces_env or base_env,
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT" if traces_env else "OTEL_EXPORTER_OTLP_ENDPOINT",
    )
    return TracingConfig(None, max_queue)


@asynccontextmanager
async def open_tracer(config: TracingConfig | None) -> AsyncIterator[Tracer | None]:
    """A :class:`~sidecar.tracing.otel.Tracer` for ``config`` (None when off) for the body; on
    leaving, the spans still queued get :data:`SHUTDOWN_TIMEOUT` seconds to leave (in a
    thread: the export may block on the network), then are given up."""
    if config is None:
        yield None
        return
    from sidecar.tracing.otel import build_tracer  # the SDK: imported only when tracing is on

    tracer = build_tracer(config)
    try:
        yield tracer
    finally:
        with trio.CancelScope(shield=True), trio.move_on_after(SHUTDOWN_TIMEOUT):
            await trio.to_thread.run_sync(tracer.shutdown, abandon_on_cancel=True)
