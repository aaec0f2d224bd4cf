"""The flags of ``run`` itself — the engine, its listeners, its streams and how it stops, traces —
checked at parse time; the client limits, the KV bridge and Dynamo add theirs
(:mod:`sidecar.north.limit_options`, :mod:`sidecar.kvbridge.options`, :mod:`sidecar.dynamo.options`).
``run --help`` shows them in sections (:mod:`sidecar.cli_help`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

from sidecar.cli_options import (
    ENGINE_ADDRESS,
    EXISTING_FILE,
    SECONDS,
    SECONDS_OR_ZERO,
    ListenAddressType,
    NewFile,
    absolute_path,
    option,
    read_token,
)
from sidecar.core.schema_options import schema_options
from sidecar.north.http_server import HttpLimits
from sidecar.tracing import TracingConfig, TracingConfigError, tracing_config

F = TypeVar("F", bound=Callable[..., Any])


def _tracing(endpoint: str | None) -> TracingConfig | None:
    """``--otlp-endpoint`` and the ``OTEL_*`` variables, checked at parse time (``sidecar.tracing``)."""
    try:
        return tracing_config(endpoint)
    except TracingConfigError as err:
        raise click.BadParameter(str(err), param_hint="--otlp-endpoint") from None


_OPTIONS: list[Callable[[Any], Any]] = [
    option(
        "--engine",
        type=ENGINE_ADDRESS,
        required=True,
        help="Engine address: host:port, http://host:port or unix:///path.",
    ),
    option(
        "--listen",
        type=ListenAddressType(),
        default="127.0.0.1:8600",
        show_default=True,
        help="WebSocket listener (the stream protocol); port 0: any free port.",
    ),
    option(
        "--http-listen",
        type=ListenAddressType(),
        default="127.0.0.1:8601",
        show_default=True,
        help="HTTP listener: probes, metrics, worker card, load.",
    ),
    option(
        "--openai-listen",
        type=ListenAddressType(),
        default=None,
        help="OpenAI-compatible API and GIE metrics (/v1/completions, /v1/chat/completions, /v1/models, /metrics); off unless given.",
    ),
    option(
        "--chat-template",
        type=EXISTING_FILE,
        default=None,
        help="Chat template (Jinja) for /v1/chat/completions, instead of the tokenizer's.",
    ),
    option(
        "--http-idle-timeout",
        type=click.FloatRange(min=0.1),
        default=5.0,
        show_default=True,
        help="Close an HTTP connection with no complete request for this long.",
    ),
    option(
        "--http-max-header-bytes",
        type=click.IntRange(min=1024),
        default=16 * 1024,
        show_default=True,
        help="Largest HTTP request line + headers (bytes).",
    ),
    option(
        "--http-max-connections",
        type=click.IntRange(min=0),
        default=HttpLimits.max_connections,
        show_default=True,
        help="Open HTTP connections (0: no limit).",
    ),
    option(
        "--http-max-connections-per-peer",
        type=click.IntRange(min=0),
        default=HttpLimits.max_connections_per_peer,
        show_default=True,
        help="Open HTTP connections per client address (0: no limit).",
    ),
    option("--model", default=None, help="Serve only this model (served name or alias)."),
    option("--expected-engine", default=None, help="Refuse to start unless the engine reports this name."),
    schema_options,
    option(
        "--startup-deadline",
        type=SECONDS,
        default=300.0,
        show_default=True,
        help="Seconds to wait for the engine.",
    ),
    option(
        "--drain-timeout",
        type=SECONDS_OR_ZERO,
        default=20.0,
        show_default=True,
        help="On SIGTERM: seconds admitted streams get to finish before they are cancelled.",
    ),
    option(
        "--drain-engine/--no-drain-engine",
        default=False,
        show_default=True,
        help="Also call the engine's Drain.",
    ),
    option(
        "--health-interval",
        type=SECONDS,
        default=1.0,
        show_default=True,
        help="Seconds between two engine Health checks.",
    ),
    option(
        "--call-timeout",
        type=SECONDS,
        default=5.0,
        show_default=True,
        help="Bound of one control call (Health, GetLoad, discovery, LoRA).",
    ),
    option("--load-interval", type=SECONDS, default=1.0, show_default=True, help="GetLoad polling interval."),
    option(
        "--inactivity-timeout",
        type=SECONDS_OR_ZERO,
        default=30.0,
        show_default=True,
        help="Fail a stream silent for this long after its first event (0: never).",
    ),
    option(
        "--first-event-timeout",
        type=SECONDS_OR_ZERO,
        default=600.0,
        show_default=True,
        help="Fail a stream with no first event (queueing, prefill) for this long (0: never).",
    ),
    option(
        "--engine-keepalive-interval",
        type=SECONDS_OR_ZERO,
        default=10.0,
        show_default=True,
        help="PING an engine connection silent this long while it owes an answer (0: never).",
    ),
    option(
        "--engine-keepalive-timeout",
        type=SECONDS,
        default=10.0,
        show_default=True,
        help="Close an engine connection whose PING goes unanswered this long.",
    ),
    option(
        "--abort-timeout",
        type=SECONDS,
        default=2.0,
        show_default=True,
        help="Bound of one Abort attempt.",
    ),
    option(
        "--abort-retry-window",
        type=SECONDS_OR_ZERO,
        default=30.0,
        show_default=True,
        help="Seconds a failed Abort is retried before it is kept for re-delivery (0: no retry).",
    ),
    option(
        "--max-undelivered-aborts",
        type=click.IntRange(min=0),
        default=4096,
        show_default=True,
        help="Aborts kept until an unreachable engine answers (full: the oldest dropped; 0: none).",
    ),
    option(
        "--max-streams",
        type=click.IntRange(min=0),
        default=4096,
        show_default=True,
        help="Admitted streams per sidecar (0: refuse every stream, OVERLOADED).",
    ),
    option(
        "--max-streams-per-connection",
        type=click.IntRange(min=1),
        default=1024,
        show_default=True,
        help="Open streams per WebSocket connection.",
    ),
    option(
        "--stall-timeout",
        type=SECONDS,
        default=30.0,
        show_default=True,
        help="Disconnect a client that reads nothing for this long.",
    ),
    option(
        "--max-message-size",
        type=click.IntRange(min=1024),
        default=4 * 1024 * 1024,
        show_default=True,
        help="Largest WebSocket message (bytes).",
    ),
    option(
        "--auth-token-file",
        "auth_token",
        type=EXISTING_FILE,
        callback=read_token,
        default=None,
        help="Require the bearer token held in this file.",
    ),
    option(
        "--lora-root",
        type=click.Path(file_okay=False),
        callback=absolute_path,
        default=None,
        help="Refuse loadLora sources outside this absolute directory.",
    ),
    option(
        "--ready-file",
        type=NewFile(),
        default=None,
        help="Write the bound addresses here (JSON) once ready.",
    ),
    option(
        "--tls-cert",
        type=EXISTING_FILE,
        default=None,
        help="Serve WebSocket and HTTP over TLS with this certificate (PEM).",
    ),
    option(
        "--tls-key",
        type=EXISTING_FILE,
        default=None,
        help="Private key of --tls-cert (PEM).",
    ),
    option(
        "--open-probes/--auth-probes",
        default=True,
        show_default=True,
        help="With --auth-token-file: leave /health and /ready open.",
    ),
    option(
        "--otlp-endpoint",
        "tracing",
        default=None,
        callback=lambda _ctx, _param, value: _tracing(value),
        help="Send a trace span per stream to this OTLP/HTTP collector (http://host:4318); "
        "OTEL_EXPORTER_OTLP_ENDPOINT works too.",
    ),
]


def run_options(f: F) -> F:
    """Apply ``run``'s own flags to ``f`` (in this module's order, top first)."""
    for decorate in reversed(_OPTIONS):
        f = decorate(f)
    return f
