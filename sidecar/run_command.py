"""``openengine-sidecar run``: serve one engine (the task tree of docs/design/architecture.md).

    trio.run(serve)
    └─ (``--dynamo`` only: the asyncio loop Dynamo's runtime needs, on trio)
       └─ engine client (its connections' tasks)
          └─ root nursery: stream supervisor (Abort retries), engine watch, load poller,
             KV bridge, HTTP, OpenAI front, WebSocket plane, Dynamo plane

:func:`serve` goes through three phases and reads SIGTERM/SIGINT in each:

- **starting** (engine wait, discovery, binding every listener): a signal stops at once,
  exit 0 with one line; every listen address is tried before any is served, all clashes in
  one line (``sidecar.listen_check``); "ready" is logged once every listener is bound.
- **serving**, until the first signal.
- **stopping**, within one deadline (:func:`sidecar.core.shutdown.stop_timeout`): leave Dynamo
  (``--dynamo``), drain (``/ready`` 503, new work DRAINING, admitted streams finish within
  ``--drain-timeout``, the rest are cancelled and aborted), then every connection sends its
  last frames and closes (the OpenAI front's last responses are written); whatever still
  runs at the deadline is cancelled. A second signal skips what is left of leaving and
  draining: every stream is cancelled at once (its Abort is still sent, within
  :func:`~sidecar.core.shutdown.stop_budget`). Exit 0.

A failure to start (engine never ready, negotiation, a port in use, a KV bridge or Dynamo
plane that cannot start, an unwritable ready file) exits 1 with one line.
"""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import click
import trio

from sidecar import sdnotify
from sidecar.addresses import join_host_port, split_host_port
from sidecar.cli_common import CommandError
from sidecar.cli_help import RUN_SECTIONS, SectionedCommand
from sidecar.core import metrics
from sidecar.core.lifecycle import LifecycleConfig
from sidecar.core.shutdown import stop_budget, stop_timeout
from sidecar.core.sidecar import OUTCOME_SHUTDOWN, Sidecar, SidecarConfig, StartupError, engine_keepalive
from sidecar.dynamo.config import DynamoConfig, DynamoConfigError
from sidecar.dynamo.options import dynamo_config, dynamo_options
from sidecar.dynamo.plane import DynamoPlane, dynamo_event_loop, start_dynamo_plane
from sidecar.kvbridge import KvBridgeConfig, KvConfigError, KvSourceError, run_kv_bridge
from sidecar.kvbridge.options import kv_bridge_config, kv_bridge_options
from sidecar.listen_check import check_run_listeners
from sidecar.loopwatch import watch_loop
from sidecar.north.http import build_app
from sidecar.north.http_server import HttpLimits, serve_http
from sidecar.north.limit_options import apply_limit_options, http_limits, limit_options, openai_config
from sidecar.north.openai.routes import OpenAIConfig, OpenAIFront
from sidecar.north.peers import fit_to_fd_limit
from sidecar.north.ws_server import WS_PATH, NorthPlane, WsConfig
from sidecar.nursery import lone_exception
from sidecar.openengine.client import open_engine_client
from sidecar.run_options import run_options
from sidecar.tracing import TracingConfig, open_tracer

log = logging.getLogger("sidecar.run")

T = TypeVar("T")
Signals = AsyncIterator[int]


async def serve(
    engine: str,
    config: SidecarConfig,
    ws: WsConfig,
    listen: str,
    http_listen: str,
    *,
    ready_file: Path | None = None,
    kv: KvBridgeConfig | None = None,
    tls: tuple[str, str] | None = None,
    open_probes: bool = True,
    http_limits: HttpLimits | None = None,
    dynamo: DynamoConfig | None = None,
    tracing: TracingConfig | None = None,
    openai_listen: str | None = None,
    openai: OpenAIConfig | None = None,
    task_status: trio.TaskStatus[dict[str, str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the sidecar until stopped (module doc); ``task_status.started(bound addresses)``."""
    async with (
        open_tracer(tracing) as tracer,
        dynamo_event_loop() if dynamo is not None else contextlib.nullcontext(),
        open_engine_client(engine, keepalive=engine_keepalive(config), limits=config.engine_limits) as client,
    ):
        sidecar = Sidecar(client, config, tracer=tracer)
        metrics.ENGINE_CHANNELS.set_function(
            lambda: client.generate_channel_count
        )  # this process's one client
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with trio.open_nursery() as root:
                root.start_soon(watch_loop)  # a starved or blocked loop says so in the log
                limits = replace(http_limits or HttpLimits(), handshake_timeout=ws.handshake_timeout)
                start = partial(
                    _start,
                    root,
                    sidecar,
                    ws,
                    listen,
                    http_listen,
                    ready_file,
                    kv,
                    tls,
                    open_probes,
                    limits,
                    dynamo,
                    (openai_listen, openai or OpenAIConfig(), _openai_limits(limits, ws))
                    if openai_listen
                    else None,
                )
                started = await _unless_signal(signals, start)
                if started is None:
                    root.cancel_scope.cancel()
                    return
                bound, north, plane, front = started
                task_status.started(bound)
                signum = await signals.__anext__()
                await _stop(sidecar, north, plane, front, signals, signum)
                root.cancel_scope.cancel()
    log.info("exited cleanly")


async def _unless_signal(signals: Signals, fn: Callable[[], Awaitable[T]]) -> T | None:
    """``await fn()``, or None (``fn`` cancelled) when a stop signal comes first."""
    result: T | None = None
    async with trio.open_nursery() as nursery:

        async def watch() -> None:
            signum = await signals.__anext__()
            log.warning("%s while starting: stopping", signal.Signals(signum).name)
            nursery.cancel_scope.cancel()

        nursery.start_soon(watch)
        result = await fn()
        nursery.cancel_scope.cancel()
    return result


async def _start(
    root: trio.Nursery,
    sidecar: Sidecar,
    ws: WsConfig,
    listen: str,
    http_listen: str,
    ready_file: Path | None,
    kv: KvBridgeConfig | None,
    tls: tuple[str, str] | None,
    open_probes: bool,
    http_limits: HttpLimits,
    dynamo: DynamoConfig | None,
    openai: tuple[str, OpenAIConfig, HttpLimits] | None,
) -> tuple[dict[str, str], NorthPlane, DynamoPlane | None, OpenAIFront | None]:
    """Wait for the engine, start every service in ``root``, bind every listener; log "ready"."""
    card = await sidecar.startup()
    await check_run_listeners(
        listen,
        http_listen,
        kv if card.kv_event_sources else None,
        card.dp_ranks,
        openai_listen=openai[0] if openai else None,
    )
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
    http_host, http_port = split_host_port(http_listen)
    bind = join_host_port(http_host, http_port)
    http_port = await _bind(
        "--http-listen",
        http_listen,
        root.start(partial(serve_http, certfile=cert, keyfile=key, limits=http_limits), app, bind),
    )
    north = NorthPlane(sidecar, ws, ssl_context=_server_ssl_context(tls) if tls else None)
    ws_host, ws_port = split_host_port(listen)
    ws_port = await _bind("--listen", listen, root.start(north.serve, ws_host, ws_port))
    secure = "s" if tls else ""
    bound = {
        "ws": f"ws{secure}://{join_host_port(ws_host, ws_port)}{WS_PATH}",
        "http": f"http{secure}://{join_host_port(http_host, http_port)}",
    }
    front = None
    if openai is not None:
        front, bound["openai"] = await _start_openai(root, sidecar, openai, tls)
    # Dynamo worker plane (optional): registered last, left first when stopping
    plane = await start_dynamo_plane(root, sidecar, dynamo, kv_topic=kv.topic if kv else "")
    if plane is not None:
        bound["dynamo"] = plane.path
    if ready_file is not None:
        try:
            await trio.Path(ready_file).write_text(json.dumps(bound))
        except OSError as err:
            raise StartupError(f"--ready-file {ready_file}: {err.strerror or err}") from None
    log.info("ready: serving %s and %s", bound["ws"], bound["http"])
    sdnotify.notify("READY=1", f"STATUS=serving {card.engine.name} {card.role} on {bound['ws']}")
    if (interval := sdnotify.watchdog_interval()) is not None:
        root.start_soon(_watchdog, interval)
    return bound, north, plane, front


async def _start_openai(
    root: trio.Nursery,
    sidecar: Sidecar,
    openai: tuple[str, OpenAIConfig, HttpLimits],
    tls: tuple[str, str] | None,
) -> tuple[OpenAIFront, str]:
    """The OpenAI front (``--openai-listen``): its chat templates found, its listener bound with
    the HTTP listener's machinery (``limits``: :func:`_openai_limits`); returns it and its base URL."""
    listen, config, limits = openai
    front = OpenAIFront(sidecar, config)
    await front.load_templates()
    cert, key = tls if tls else (None, None)
    host, port = split_host_port(listen)
    bind = join_host_port(host, port)
    serving = partial(serve_http, certfile=cert, keyfile=key, limits=limits)
    port = await _bind("--openai-listen", listen, root.start(serving, front.app(), bind))
    url = f"http{'s' if tls else ''}://{join_host_port(host, port)}/v1"
    log.info("OpenAI-compatible API on %s", url)
    return front, url


def _openai_limits(http: HttpLimits, ws: WsConfig) -> HttpLimits:
    """The OpenAI listener's limits: the HTTP listener's headers and timeouts, the WebSocket
    listener's connection counts and stall timeout (both serve clients' streams)."""
    return replace(
        http,
        max_connections=fit_to_fd_limit(ws.max_connections),
        max_connections_per_peer=ws.max_connections_per_peer,
        prefix="openai_",
        write_timeout=ws.stall_timeout,
    )


async def _bind(flag: str, address: str, starting: Awaitable[Any]) -> int:
    """Await a listener's start; a bind failure becomes a one-line :class:`StartupError`."""
    try:
        port: int = await starting
    except (OSError, BaseExceptionGroup) as err:
        leaf = lone_exception(err)
        if isinstance(leaf, OSError):
            raise StartupError(f"{flag} {address}: cannot listen: {leaf.strerror or leaf}") from None
        raise
    return port


async def _stop(
    sidecar: Sidecar,
    north: NorthPlane,
    plane: DynamoPlane | None,
    front: OpenAIFront | None,
    signals: Signals,
    signum: int,
) -> None:
    """Leave Dynamo, drain, close the connections: all before one deadline (module doc)."""
    cfg = sidecar.config
    abort_timeout = cfg.lifecycle.abort_timeout
    budget = stop_timeout(cfg.drain_timeout, abort_timeout, plane.leave_budget if plane else 0.0)
    log.info(
        "%s: stopping within %.1fs (a second signal cancels every stream at once)",
        signal.Signals(signum).name,
        budget,
    )
    sdnotify.notify("STOPPING=1", "STATUS=draining")
    with trio.move_on_after(budget) as deadline:
        async with trio.open_nursery() as nursery:
            graceful = trio.CancelScope()

            async def second_signal() -> None:
                sig = await signals.__anext__()
                log.warning("%s again: cancelling every stream now", signal.Signals(sig).name)
                graceful.cancel()
                deadline.deadline = min(deadline.deadline, trio.current_time() + stop_budget(abort_timeout))

            nursery.start_soon(second_signal)
            with graceful:
                if plane is not None:
                    await plane.leave()  # Dynamo routes no new work here (then its grace)
                await sidecar.drain()
            sidecar.start_draining()  # (already, unless a second signal came before the drain)
            await sidecar.stop_streams(OUTCOME_SHUTDOWN)
            north.close()  # every connection sends its last frames, then closes (1001)
            if front is not None:
                front.close()  # new requests 503; the last responses are written
                await front.wait_idle()
            await north.wait_closed()
            nursery.cancel_scope.cancel()
    if deadline.cancelled_caught:
        log.warning("stop deadline reached: closing what is left")


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
        info = await root.start(
            partial(run_kv_bridge, kv, engine_client=sidecar.engine, tracer=sidecar.tracer)
        )
    except (KvConfigError, KvSourceError, OSError) as err:
        raise StartupError(f"KV event bridge: {err}") from None
    endpoints = [r.publish_endpoint for r in info.ranks]
    sidecar.set_kv_publish_endpoints(endpoints)
    ranks = ", ".join(f"rank {r.rank}: {r.publish_endpoint} (replay {r.replay_endpoint})" for r in info.ranks)
    log.info("KV events bridged from %s to %s", info.ranks[0].source if info.ranks else "?", ranks)


def _server_ssl_context(tls: tuple[str, str]) -> ssl.SSLContext:
    """The listeners' TLS context; ``ssl.SSLError``/``OSError`` for unusable PEM files."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(*tls)
    return context


async def _watchdog(interval: float) -> None:
    """Pet systemd's watchdog while the event loop runs (a hung loop stops petting)."""
    while True:
        sdnotify.notify("WATCHDOG=1")
        await trio.sleep(interval)


@click.command("run", cls=SectionedCommand, sections=RUN_SECTIONS)
@run_options
@limit_options
@kv_bridge_options
@dynamo_options
def run(**opts: Any) -> None:
    """Serve one OpenEngine engine to routers and frontends.

    Stops on SIGTERM/SIGINT (drain, then exit 0; a second signal cancels every stream at once).
    Exit status: 0 stopped, 1 could not start (one line says why), 2 a bad flag value.
    """
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
        lora_root=opts["lora_root"],
        lifecycle=LifecycleConfig(
            abort_timeout=opts["abort_timeout"],
            abort_retry_window=opts["abort_retry_window"],
            max_undelivered_aborts=opts["max_undelivered_aborts"],
            inactivity_timeout=opts["inactivity_timeout"],
            first_event_timeout=opts["first_event_timeout"],
            max_streams=opts["max_streams"],
        ),
    )
    ws = WsConfig(
        max_message_size=opts["max_message_size"],
        max_streams_per_connection=opts["max_streams_per_connection"],
        stall_timeout=opts["stall_timeout"],
        auth_token=opts["auth_token"],
    )
    apply_limit_options(opts, ws, config)
    ready_file = Path(opts["ready_file"]) if opts["ready_file"] else None
    tls = _tls(opts["tls_cert"], opts["tls_key"])
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
                opts["listen"],
                opts["http_listen"],
                ready_file=ready_file,
                kv=kv,
                tls=tls,
                open_probes=opts["open_probes"],
                http_limits=http_limits(opts),
                dynamo=dynamo,
                tracing=opts["tracing"],
                openai_listen=opts["openai_listen"],
                openai=openai_config(opts, ws),
            )
        )
    except (StartupError, BaseExceptionGroup) as err:
        leaf = lone_exception(err)
        if isinstance(leaf, StartupError):
            raise CommandError(str(leaf)) from None
        raise


def _tls(cert: str | None, key: str | None) -> tuple[str, str] | None:
    """Both PEM files or neither; loaded once here, so unusable material is a usage error."""
    if bool(cert) != bool(key):
        raise click.BadParameter("give both --tls-cert and --tls-key", param_hint="--tls-cert/--tls-key")
    if cert is None or key is None:
        return None
    try:
        _server_ssl_context((cert, key))
    except (ssl.SSLError, OSError) as err:
        reason = getattr(err, "reason", None) or getattr(err, "strerror", None) or str(err)
        raise click.BadParameter(
            f"cannot load {cert} / {key}: {reason}", param_hint="--tls-cert/--tls-key"
        ) from None
    return cert, key
