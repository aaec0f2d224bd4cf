"""The bridge's command-line flags, for the ``run`` command (each also reads ``OPENENGINE_SIDECAR_*``).

Usage::

    @click.command()
    @kv_bridge_options
    def run(..., **kw):
        kv_config = kv_bridge_config(kw)   # None with --no-kv-events
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import click

from sidecar.cli_options import HostName, option
from sidecar.kvbridge.errors import KvConfigError
from sidecar.kvbridge.ingest_limits import IngestLimits
from sidecar.kvbridge.replay_server import ReplayLimits
from sidecar.kvbridge.service import KvBridgeConfig

F = TypeVar("F", bound=Callable[..., Any])

_OPTIONS = [
    option(
        "--kv-events/--no-kv-events",
        "kv_events",
        default=True,
        show_default=True,
        help="Bridge the engine's KV cache events to a ZMQ publisher per DP rank (vLLM's protocol).",
    ),
    option(
        "--kv-publish",
        default="tcp://127.0.0.1:5600",
        show_default=True,
        help="PUB endpoint of DP rank 0 (rank r: port + r; port 0: any free port).",
    ),
    option(
        "--kv-replay",
        default="tcp://127.0.0.1:5700",
        show_default=True,
        help="Replay ROUTER endpoint of DP rank 0 (rank r: port + r; 'none': no replay).",
    ),
    option(
        "--kv-buffer-steps",
        type=click.IntRange(min=1),
        default=10_000,
        show_default=True,
        help="Batches held per rank for replay.",
    ),
    option("--kv-topic", default="", show_default=True, help="ZMQ topic of published batches."),
    option(
        "--kv-hwm",
        type=click.IntRange(min=0),
        default=100_000,
        show_default=True,
        help="ZMQ high-water mark.",
    ),
    option(
        "--kv-replay-hwm",
        type=click.IntRange(min=1),
        default=ReplayLimits.hwm,
        show_default=True,
        help="Replay batches queued per peer.",
    ),
    option(
        "--kv-replay-socket-buffer",
        type=click.IntRange(min=4096),
        default=ReplayLimits.socket_buffer,
        show_default=True,
        help="Kernel send buffer per replay peer (bytes).",
    ),
    option(
        "--kv-replay-max-active",
        type=click.IntRange(min=1),
        default=ReplayLimits.max_active,
        show_default=True,
        help="Replays served at once per rank.",
    ),
    option(
        "--kv-replay-stall-timeout",
        type=click.FloatRange(min=0, min_open=True),
        default=ReplayLimits.stall_timeout,
        show_default=True,
        help="Drop a replay whose peer reads nothing this many seconds.",
    ),
    option(
        "--kv-zmq-heartbeat",
        type=click.FloatRange(min=0),
        default=2.0,
        show_default=True,
        help="Heartbeat interval on a ZMQ source's subscription (0: off).",
    ),
    option(
        "--kv-silence-probe",
        type=click.FloatRange(min=0),
        default=10.0,
        show_default=True,
        help="Seconds without a batch before asking a ZMQ source's replay (0: never).",
    ),
    option(
        "--kv-heartbeat",
        type=click.FloatRange(min=0),
        default=5.0,
        show_default=True,
        help="Publish a batch with no events (the next sequence number) after this many idle "
        "seconds, so consumers see a gap while the engine is idle (0: never).",
    ),
    option(
        "--kv-max-batch-bytes",
        type=click.IntRange(min=1024),
        default=IngestLimits.max_batch_bytes,
        show_default=True,
        help="Largest KV event batch taken from the engine (bytes).",
    ),
    option(
        "--kv-engine-replay-max-batches",
        type=click.IntRange(min=1),
        default=IngestLimits.replay_max_batches,
        show_default=True,
        help="Most batches one replay from the engine may bring.",
    ),
    option(
        "--kv-engine-replay-max-bytes",
        type=click.IntRange(min=1024),
        default=IngestLimits.replay_max_bytes,
        show_default=True,
        help="Most bytes one replay from the engine may bring.",
    ),
    option(
        "--kv-engine-replay-deadline",
        type=click.FloatRange(min=0, min_open=True),
        default=IngestLimits.replay_deadline,
        show_default=True,
        help="Seconds one replay from the engine may take.",
    ),
    option(
        "--kv-advertise-host",
        type=HostName(),
        default=None,
        help="Host the worker card gives for the KV endpoints (when binding a wildcard).",
    ),
]


def kv_bridge_options(f: F) -> F:
    """Add the ``--kv-*`` flags to a click command."""
    for decorator in reversed(_OPTIONS):
        f = decorator(f)
    return f


def kv_bridge_config(values: Mapping[str, Any], **overrides: Any) -> KvBridgeConfig | None:
    """The :class:`KvBridgeConfig` from a command's parsed ``--kv-*`` values (``None``: disabled).

    ``overrides`` set other fields (e.g. ``dp_ranks`` from discovery). Raises
    :class:`KvConfigError` (a ``click.BadParameter`` is left to the caller) for bad values.
    """
    if not values.get("kv_events", True):
        return None
    replay = values.get("kv_replay")
    if replay is not None and replay.strip().lower() in ("", "none", "off"):
        replay = None
    config = KvBridgeConfig(
        publish_endpoint=values["kv_publish"],
        replay_endpoint=replay,
        buffer_steps=values["kv_buffer_steps"],
        topic=values["kv_topic"],
        hwm=values["kv_hwm"],
        heartbeat=values.get("kv_heartbeat", 5.0),
        zmq_heartbeat=values.get("kv_zmq_heartbeat", 2.0),
        silence_probe=values.get("kv_silence_probe", 10.0),
        advertise_host=values.get("kv_advertise_host") or None,
        replay_limits=ReplayLimits(
            hwm=values.get("kv_replay_hwm", ReplayLimits.hwm),
            socket_buffer=values.get("kv_replay_socket_buffer", ReplayLimits.socket_buffer),
            max_active=values.get("kv_replay_max_active", ReplayLimits.max_active),
            stall_timeout=values.get("kv_replay_stall_timeout", ReplayLimits.stall_timeout),
        ),
        ingest_limits=IngestLimits(
            max_batch_bytes=values.get("kv_max_batch_bytes", IngestLimits.max_batch_bytes),
            replay_max_batches=values.get("kv_engine_replay_max_batches", IngestLimits.replay_max_batches),
            replay_max_bytes=values.get("kv_engine_replay_max_bytes", IngestLimits.replay_max_bytes),
            replay_deadline=values.get("kv_engine_replay_deadline", IngestLimits.replay_deadline),
        ),
        **overrides,
    )
    config.validate()
    return config


__all__ = ["KvConfigError", "kv_bridge_config", "kv_bridge_options"]
