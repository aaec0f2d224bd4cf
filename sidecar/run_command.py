"""``openengine-sidecar run``: serve one engine (the task tree of docs/design/architecture.md).

    trio.run(main)
    └─ trio_asyncio loop (grpclib lives there, nowhere else)
       └─ root nursery: stream supervisor (Abort retries), engine watch, load poller,
          HTTP, WebSocket plane, drain supervisor (signals)

SIGTERM/SIGINT: drain (``/ready`` 503, new work DRAINING, admitted streams finish within
``--drain-timeout``, the rest cancelled and aborted), then exit 0. A second signal cancels
everything at once (aborts are still sent, bounded). Startup failures exit 1 with one line.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import ssl
import sys
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import click
import msgspec
import trio
import trio_asyncio

from sidecar import sdnotify
from sidecar.cli_options import option, read_token_file
from sidecar.core.lifecycle import LifecycleConfig
from sidecar.core.schema_options import schema_options
from sidecar.core.sidecar import OUTCOME_SHUTDOWN, Sidecar, SidecarConfig, StartupError, engine_keepalive
from sidecar.dynamo.config import DynamoConfig, DynamoConfigError
from sidecar.dynamo.options import dynamo_config, dynamo_options
from sidecar.dynamo.plane import leave_before_drain, start_dynamo_plane
from sidecar.kvbridge import KvBridgeConfig, KvConfigError, KvSourceError, run_kv_bridge
from sidecar.kvbridge.options import kv_bridge_config, kv_bridge_options
from sidecar.north.http import build_app
from sidecar.north.http_server import HttpLimits, serve_http
from sidecar.north.limit_options import apply_limit_options, limit_options
from sidecar.north.ws_server import WS_PATH, NorthPlane, WsConfig
from sidecar.openengine.client import open_engine_client
from sidecar.openengine.errors import EngineConfigError

log = logging.getLogger("sidecar.run")


def split_host_port(text: str, flag: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise click.BadParameter(f"{text!r}: expected HOST:PORT", param_hint=flag)
    return host.strip("[]") or "127.0.0.1", int(port)


async def serve(
    engine: str,
    config: SidecarConfig,
    ws: WsConfig,
    listen: tuple[str, int],
    http_listen: str,
    *,
    ready_file: Path | None = None,
    kv: KvBridgeConfig | None = None,
    tls: tuple[str, str] | None = None,
    open_probes: bool = True,
    http_limits: HttpLimits | None = None,
    dynamo: DynamoConfig | None = None,
    task_status: Any = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the sidecar until drained; ``task_status.started(dict of bound addresses)``."""
    async with (
        trio_asyncio.open_loop(),
        open_engine_client(engine, keepalive=engine_keepalive(config), limits=config.engine_limits) as client,
    ):
        sidecar = Sidecar(client, config)
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            card = await sidecar.startup()
            async with trio.open_nursery() as root:
                await root.start(sidecar.supervisor.run_service)
                await _start_kv_bridge(root, sidecar, kv)
                log.info(
                    "engine %s %s (%s), schema revision %d, release %s; models: %s",
                    card.engine.name,
                    card.engine.version,
                    card.role,
                    card.schema.revision,
                    card.schema.release,
                    ", ".join(card.served_model_names),
                )
                await root.start(sidecar.watch_engine)
                await root.start(sidecar.poll_load)
                cert, key = tls if tls else (None, None)
                app = build_app(sidecar, auth_token=ws.auth_token, open_probes=open_probes)
                limits = replace(http_limits or HttpLimits(), handshake_timeout=ws.handshake_timeout)
                http_port = await root.start(
                    partial(serve_http, certfile=cert, keyfile=key, limits=limits), app, http_listen
                )
                north = NorthPlane(sidecar, ws, ssl_context=_server_ssl_context(tls) if tls else None)
                ws_port = await root.start(north.serve, listen[0], listen[1])
                secure = "s" if tls else ""
                http_host = http_listen.rpartition(":")[0] or "127.0.0.1"
                bound = {
                    "ws": f"ws{secure}://{_hostport(listen[0], ws_port)}{WS_PATH}",
                    "http": f"http{secure}://{_hostport(http_host, http_port)}",
                }
                log.info("serving %s and %s", bound["ws"], bound["http"])
                # Dynamo worker plane (optional): registered last, left first on SIGTERM. Its
                # start can wait long for etcd/NATS: a signal meanwhile stops the sidecar.
                started, plane = await _unless_signalled(
                    signals,
                    partial(start_dynamo_plane, root, sidecar, dynamo, kv_topic=kv.topic if kv else ""),
                )
                if not started:
                    root.cancel_scope.cancel()
                    return
                if plane is not None:
                    bound["dynamo"] = plane.path
                if ready_file is not None:
                    await trio.Path(ready_file).write_text(json.dumps(bound))
                sdnotify.notify("READY=1", f"STATUS=serving {card.engine.name} {card.role} on {bound['ws']}")
                if (interval := sdnotify.watchdog_interval()) is not None:
                    root.start_soon(_watchdog, interval)
                task_status.started(bound)
                await _drain_on_signal(sidecar, leave_before_drain(signals, plane))
                await north.close_gracefully()
                root.cancel_scope.cancel()
    log.info("exited cleanly")


async def _unless_signalled(signals: Any, start: Any) -> tuple[bool, Any]:
    """``(True, await start())``, or ``(False, None)`` when SIGTERM/SIGINT comes first (the
    start is cancelled; logged)."""
    result: list[Any] = []
    async with trio.open_nursery() as nursery:

        async def watch() -> None:
            signum = await signals.__anext__()
            log.warning("%s while starting: stopping", signal.Signals(signum).name)
            nursery.cancel_scope.cancel()

        nursery.start_soon(watch)
        result.append(await start())
        nursery.cancel_scope.cancel()
    return (True, result[0]) if result else (False, None)


async def _start_kv_bridge(root: trio.Nursery, sidecar: Sidecar, kv: KvBridgeConfig | None) -> None:
    """Start the KV event bridge when enabled and the engine advertises KV event sources.

    A bridge that cannot start (bad settings, a port in use, unusable sources) fails startup:
    a router must not believe this worker publishes events it never will.
    """
    card = sidecar.card
    if kv is None:
        log.info("KV event bridge disabled (--no-kv-events)")
        return
    if card is None or not card.kv_event_sources:
        log.info("engine advertises no KV event sources: KV event bridge not started")
        return
    kv = replace(kv, dp_ranks=tuple(card.dp_ranks))
    try:
        info = await root.start(partial(run_kv_bridge, kv, engine_client=sidecar.engine))
    except (KvConfigError, KvSourceError, OSError) as err:
        raise StartupError(f"KV event bridge: {err}") from None
    endpoints = [r.publish_endpoint for r in info.ranks]
    sidecar.config.kv_publish_endpoints = endpoints
    sidecar.card = msgspec.structs.replace(card, kv_publish_endpoints=endpoints)
    ranks = ", ".join(f"rank {r.rank}: {r.publish_endpoint} (replay {r.replay_endpoint})" for r in info.ranks)
    log.info("KV events bridged from %s to %s", info.ranks[0].source if info.ranks else "?", ranks)


def _server_ssl_context(tls: tuple[str, str]) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(*tls)
    return context


async def _watchdog(interval: float) -> None:
    """Pet systemd's watchdog while the event loop runs (a hung loop stops petting)."""
    while True:
        sdnotify.notify("WATCHDOG=1")
        await trio.sleep(interval)


def _hostport(host: str, port: int) -> str:
    host = host.strip("[]")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def _drain_on_signal(sidecar: Sidecar, signals: Any) -> None:
    signum = await signals.__anext__()
    log.info("%s: draining (a second signal stops at once)", signal.Signals(signum).name)
    sdnotify.notify("STOPPING=1", "STATUS=draining")
    async with trio.open_nursery() as nursery:

        async def second_signal() -> None:
            sig = await signals.__anext__()
            log.warning("%s again: cancelling every stream now", signal.Signals(sig).name)
            sidecar.supervisor.cancel_all(OUTCOME_SHUTDOWN)
            nursery.cancel_scope.cancel()

        nursery.start_soon(second_signal)
        await sidecar.drain()
        nursery.cancel_scope.cancel()
    with trio.move_on_after(sidecar.config.lifecycle.abort_timeout + 1):
        await sidecar.supervisor.wait_idle()


@click.command("run")
@option("--engine", required=True, help="Engine address: host:port, http://host:port or unix:///path.")
@option("--listen", default="127.0.0.1:8600", show_default=True, help="WebSocket listener (north protocol).")
@option("--http-listen", default="127.0.0.1:8601", show_default=True, help="HTTP health/ready/metrics.")
@option(
    "--http-idle-timeout",
    type=click.FloatRange(min=0.1),
    default=5.0,
    show_default=True,
    help="Close an HTTP connection without a complete request for this long (idle or slow headers).",
)
@option(
    "--http-max-header-bytes",
    type=click.IntRange(min=1024),
    default=16 * 1024,
    show_default=True,
    help="Largest HTTP request line + headers; larger requests get 400.",
)
@option("--model", default=None, help="Serve only this model (served name or alias).")
@option("--expected-engine", default=None, help="Refuse to start unless the engine reports this name.")
@schema_options
@option(
    "--startup-deadline", type=float, default=300.0, show_default=True, help="Seconds to wait for the engine."
)
@option("--drain-timeout", type=float, default=20.0, show_default=True, help="Grace for admitted streams.")
@option(
    "--drain-engine/--no-drain-engine", default=False, show_default=True, help="Also call the engine's Drain."
)
@option("--health-interval", type=float, default=1.0, show_default=True)
@option(
    "--call-timeout",
    type=float,
    default=5.0,
    show_default=True,
    help="Bound of one control call (Health, GetLoad, discovery, LoRA); two Health timeouts in a row mark the engine lost.",
)
@option("--load-interval", type=float, default=1.0, show_default=True, help="GetLoad polling interval.")
@option(
    "--inactivity-timeout",
    type=click.FloatRange(min=0),
    default=30.0,
    show_default=True,
    help="Fail a stream whose engine sent nothing for this long after its first event (0: never).",
)
@option(
    "--first-event-timeout",
    type=click.FloatRange(min=0),
    default=600.0,
    show_default=True,
    help="Fail a stream whose engine sent no first event for this long: queueing and prefill (0: never).",
)
@option(
    "--engine-keepalive-interval",
    type=click.FloatRange(min=0),
    default=10.0,
    show_default=True,
    help="HTTP/2 PING an engine connection silent for this long while it owes an answer (0: never).",
)
@option(
    "--engine-keepalive-timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=10.0,
    show_default=True,
    help="Close an engine connection whose PING is not answered within this long.",
)
@option("--abort-timeout", type=float, default=2.0, show_default=True, help="Bound of one Abort attempt.")
@option(
    "--abort-retry-window",
    type=float,
    default=30.0,
    show_default=True,
    help="How long failed Aborts are retried.",
)
@option("--max-streams", type=int, default=4096, show_default=True, help="Admitted streams per sidecar.")
@option("--max-streams-per-connection", type=int, default=1024, show_default=True)
@option(
    "--stall-timeout",
    type=float,
    default=30.0,
    show_default=True,
    help="Disconnect a client that reads nothing for this long.",
)
@option(
    "--max-message-size",
    type=int,
    default=4 * 1024 * 1024,
    show_default=True,
    help="Largest WebSocket message.",
)
@option(
    "--auth-token-file",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="Require this bearer token.",
)
@option(
    "--lora-root",
    type=click.Path(file_okay=False),
    default=None,
    help="Refuse loadLora calls whose source path is not under this directory (absolute).",
)
@option(
    "--ready-file",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write the bound addresses here (JSON) once ready.",
)
@option(
    "--tls-cert",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="Serve WebSocket and HTTP over TLS with this certificate (PEM).",
)
@option(
    "--tls-key",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="Private key of --tls-cert (PEM).",
)
@option(
    "--open-probes/--auth-probes",
    default=True,
    show_default=True,
    help="With --auth-token-file: leave /health and /ready open.",
)
@limit_options
@kv_bridge_options
@dynamo_options
def run(**opts: Any) -> None:
    """Serve one OpenEngine engine to routers and frontends."""
    listen = split_host_port(opts["listen"], "--listen")
    split_host_port(opts["http_listen"], "--http-listen")
    token = read_token_file(opts["auth_token_file"])
    if opts["auth_token_file"] and not token:
        raise click.BadParameter("the token file is empty", param_hint="--auth-token-file")
    config = SidecarConfig(
        model=opts["model"],
        expected_engine=opts["expected_engine"],
        expected_release=opts["expected_schema_release"],
        require_known_release=opts["require_known_release"],
        handoff_profile=opts["handoff_profile"],
        startup_deadline=opts["startup_deadline"],
        drain_timeout=opts["drain_timeout"],
        drain_engine=opts["drain_engine"],
        health_interval=opts["health_interval"],
        call_timeout=opts["call_timeout"],
        keepalive_interval=opts["engine_keepalive_interval"],
        keepalive_timeout=opts["engine_keepalive_timeout"],
        load_interval=opts["load_interval"],
        lora_root=_lora_root(opts["lora_root"]),
        lifecycle=LifecycleConfig(
            abort_timeout=opts["abort_timeout"],
            abort_retry_window=opts["abort_retry_window"],
            inactivity_timeout=opts["inactivity_timeout"],
            first_event_timeout=opts["first_event_timeout"],
            max_streams=opts["max_streams"],
        ),
    )
    ws = WsConfig(
        max_message_size=opts["max_message_size"],
        max_streams_per_connection=opts["max_streams_per_connection"],
        stall_timeout=opts["stall_timeout"],
        auth_token=token,
    )
    apply_limit_options(opts, ws, config)
    ready_file = Path(opts["ready_file"]) if opts["ready_file"] else None
    if bool(opts["tls_cert"]) != bool(opts["tls_key"]):
        raise click.BadParameter("give both --tls-cert and --tls-key", param_hint="--tls-cert")
    tls = (opts["tls_cert"], opts["tls_key"]) if opts["tls_cert"] else None
    try:
        kv = kv_bridge_config(opts)
    except KvConfigError as err:
        raise click.BadParameter(str(err), param_hint="--kv-publish/--kv-replay") from None
    try:
        dynamo = dynamo_config(opts)
    except DynamoConfigError as err:
        raise click.BadParameter(str(err), param_hint="--dynamo-*") from None
    try:
        trio.run(
            partial(
                serve,
                opts["engine"],
                config,
                ws,
                listen,
                opts["http_listen"],
                ready_file=ready_file,
                kv=kv,
                tls=tls,
                open_probes=opts["open_probes"],
                http_limits=HttpLimits(
                    idle_timeout=opts["http_idle_timeout"], max_header_bytes=opts["http_max_header_bytes"]
                ),
                dynamo=dynamo,
            )
        )
    except (StartupError, EngineConfigError, BaseExceptionGroup) as err:
        leaf = _lone_leaf(err)
        if isinstance(leaf, EngineConfigError):
            raise click.BadParameter(str(leaf), param_hint="--engine") from None
        if isinstance(leaf, StartupError):
            click.echo(f"openengine-sidecar: {leaf}", err=True)
            sys.exit(1)
        raise


def _lora_root(value: str | None) -> str | None:
    if value is None:
        return None
    if not value.startswith("/"):
        raise click.BadParameter("must be an absolute path", param_hint="--lora-root")
    return os.path.normpath(value)


def _lone_leaf(exc: BaseException) -> BaseException:
    """The single exception inside (possibly nested) one-member exception groups."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc
