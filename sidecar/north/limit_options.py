"""``run`` flags of the limits a client meets, and of what the engine may send
(docs/SECURITY.md); each also reads ``OPENENGINE_SIDECAR_<FLAG>``.

Usage::

    @click.command()
    @limit_options
    def run(**opts):
        ws, config = WsConfig(...), SidecarConfig(...)
        apply_limit_options(opts, ws, config)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import click

from sidecar.cli_options import option
from sidecar.core.lifecycle import LifecycleConfig
from sidecar.core.sidecar import SidecarConfig
from sidecar.north.http_server import HttpLimits
from sidecar.north.openai.routes import OpenAIConfig
from sidecar.north.ws_server import WsConfig
from sidecar.openengine.message_limits import EngineLimits

F = TypeVar("F", bound=Callable[..., object])

_COUNT = click.IntRange(min=0)
_ENGINE_BYTES = click.IntRange(min=64 * 1024)

_OPTIONS = [
    option(
        "--max-connections",
        type=_COUNT,
        default=WsConfig.max_connections,
        show_default=True,
        help="Open WebSocket connections (0: no limit; lowered to fit the fd limit).",
    ),
    option(
        "--max-connections-per-peer",
        type=_COUNT,
        default=WsConfig.max_connections_per_peer,
        show_default=True,
        help="Open WebSocket connections per client address (0: no limit).",
    ),
    option(
        "--peer-stream-share",
        type=click.FloatRange(min=0.0, max=1.0, min_open=True),
        default=0.5,
        show_default=True,
        help="Share of --max-streams one client address may hold (1: no limit).",
    ),
    option(
        "--handshake-timeout",
        type=click.FloatRange(min=0.1),
        default=WsConfig.handshake_timeout,
        show_default=True,
        help="Seconds to complete the WebSocket (and TLS) handshake.",
    ),
    option(
        "--max-calls-per-connection",
        type=click.IntRange(min=1),
        default=WsConfig.max_calls_per_connection,
        show_default=True,
        help="'call' messages in progress per connection.",
    ),
    option(
        "--max-pending-bytes",
        type=click.IntRange(min=1024),
        default=WsConfig.max_pending_bytes,
        show_default=True,
        help="Bytes queued for a slow-reading client before its streams wait.",
    ),
    option(
        "--client-engine-calls",
        type=_COUNT,
        default=SidecarConfig.client_engine_calls,
        show_default=True,
        help="Engine calls for clients (LoRA, releaseKvSession) at once (0: no limit).",
    ),
    option(
        "--client-engine-calls-per-connection",
        type=_COUNT,
        default=SidecarConfig.client_engine_calls_per_connection,
        show_default=True,
        help="Of those, at most this many per connection (0: no limit).",
    ),
    option(
        "--max-request-id-length",
        type=click.IntRange(min=1),
        default=LifecycleConfig.max_request_id_length,
        show_default=True,
        help="Longest requestId a client may give.",
    ),
    option(
        "--engine-max-event-bytes",
        type=_ENGINE_BYTES,
        default=EngineLimits.max_event_bytes,
        show_default=True,
        help="Largest Generate event the engine may send (bytes).",
    ),
    option(
        "--engine-max-answer-bytes",
        type=_ENGINE_BYTES,
        default=EngineLimits.max_answer_bytes,
        show_default=True,
        help="Largest control-call answer or Drain event the engine may send (bytes).",
    ),
]


def limit_options(f: F) -> F:
    """Add the limit flags to a click command."""
    for decorator in reversed(_OPTIONS):
        f = decorator(f)
    return f


def apply_limit_options(values: Mapping[str, Any], ws: WsConfig, config: SidecarConfig) -> None:
    """Set the limits of ``ws`` and ``config`` from a command's parsed flags (``config``'s
    ``lifecycle.max_streams`` must be set already: the per-peer share is of it). ``values`` are
    click's keyword arguments, untyped there: each has the type of its option's ``type=``."""
    max_streams = config.lifecycle.max_streams
    share = values["peer_stream_share"]
    ws.max_connections = values["max_connections"]
    ws.max_connections_per_peer = values["max_connections_per_peer"]
    ws.max_streams_per_peer = 0 if share >= 1 else max(1, int(max_streams * share))
    ws.handshake_timeout = values["handshake_timeout"]
    ws.max_calls_per_connection = values["max_calls_per_connection"]
    ws.max_pending_bytes = values["max_pending_bytes"]
    config.client_engine_calls = values["client_engine_calls"]
    config.client_engine_calls_per_connection = values["client_engine_calls_per_connection"]
    config.lifecycle = dataclasses.replace(
        config.lifecycle, max_request_id_length=values["max_request_id_length"]
    )
    config.engine_limits = dataclasses.replace(
        config.engine_limits,
        max_event_bytes=values["engine_max_event_bytes"],
        max_answer_bytes=values["engine_max_answer_bytes"],
    )


def openai_config(values: Mapping[str, Any], ws: WsConfig) -> OpenAIConfig:
    """The OpenAI front's settings from ``run``'s flags and the WebSocket plane's limits (set by
    :func:`apply_limit_options` first): the body is bounded like a WebSocket message, must
    arrive within the handshake timeout; open requests per client address are the WebSocket
    streams' share (the listener's stall timeout: ``run_command._openai_limits``)."""
    return OpenAIConfig(
        auth_token=ws.auth_token,
        max_body_bytes=ws.max_message_size,
        body_timeout=ws.handshake_timeout,
        max_streams_per_peer=ws.max_streams_per_peer,
        chat_template=values["chat_template"],
    )


def http_limits(values: Mapping[str, Any]) -> HttpLimits:
    """The HTTP listener's limits from ``run``'s ``--http-*`` flags (the TLS handshake timeout
    is set from ``--handshake-timeout`` when serving)."""
    return HttpLimits(
        idle_timeout=values["http_idle_timeout"],
        max_header_bytes=values["http_max_header_bytes"],
        max_connections=values["http_max_connections"],
        max_connections_per_peer=values["http_max_connections_per_peer"],
    )
