"""Wiring of one simulated engine process: KV events, KV transfer, the gRPC server.

:func:`serve_engine` is the asyncio entry point used by the CLI (``asyncio.run``) and,
in-process, by tests (on trio-asyncio: tests/mock_engines.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import zmq

from sidecar.mock.config import EngineConfig
from sidecar.mock.engine import MockEngine
from sidecar.mock.kvevents import ZmqKvEvents
from sidecar.mock.kvevents_grpc import GrpcKvEvents
from sidecar.mock.kvevents_model import KvGroundTruth
from sidecar.mock.kvevents_wire import KvFaults
from sidecar.mock.services import SimulatedControl, SimulatedInference
from sidecar.mock.transfer import KvTransferServer
from sidecar.openengine.serving.grpc_server import open_server

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServingInfo:
    """What a started engine tells its launcher (the ready file's content)."""

    address: str
    flavor: str
    role: str
    instance_id: str
    kv_events: str
    kv_endpoints: tuple[str, ...]
    transfer_endpoint: str

    def to_json(self) -> dict[str, object]:
        return {
            "address": self.address,
            "flavor": self.flavor,
            "role": self.role,
            "instance_id": self.instance_id,
            "kv_events": self.kv_events,
            "kv_endpoints": list(self.kv_endpoints),
            "transfer_endpoint": self.transfer_endpoint,
        }


class BindError(OSError):
    """A listener besides the gRPC one (KV publisher, KV transfer) could not be bound; the
    message names its flags."""


@contextlib.asynccontextmanager
async def open_engine(
    config: EngineConfig, *, exit_process: Callable[[int], None] | None = None
) -> AsyncIterator[tuple[MockEngine, ServingInfo]]:
    """Start every part of a simulated engine; yields once the gRPC server listens.

    Resources: the gRPC listener, ZMQ publisher/replay sockets (zmq transport), the KV
    transfer listener (prefill role), an optional ``--kv-log`` file. All are closed on
    exit, the gRPC server first (its handlers are cancelled). Raises :class:`BindError` when the
    KV publisher or the transfer listener cannot be bound, OSError when the gRPC address cannot.
    """
    transport = config.kv_events_transport
    kv_options = config.faults.kv_options()
    faults = KvFaults.from_kv_options(kv_options, tagged_arrays=config.kv_event_format == "array")
    async with contextlib.AsyncExitStack() as stack:
        ground_truth = KvGroundTruth(config.kv_log) if config.kv_log else None
        if ground_truth is not None:
            stack.callback(ground_truth.close)
        sink: ZmqKvEvents | GrpcKvEvents | None = None
        if transport == "zmq":
            sink = ZmqKvEvents(
                range(config.dp_size),
                bind_host=config.kv_host,
                port=config.kv_port,
                style="sglang" if config.flavor == "sglang" else "vllm",
                buffer_steps=config.kv_buffer_steps,
                faults=faults,
            )
            try:
                await stack.enter_async_context(sink)
            except (OSError, zmq.ZMQError) as err:
                where = f"--kv-host {config.kv_host} --kv-port {config.kv_port}"
                raise BindError(f"{where}: cannot bind the KV event publisher: {err}") from None
        elif transport == "grpc":
            grpc_sink = GrpcKvEvents(
                range(config.dp_size), buffer_steps=config.kv_buffer_steps, faults=faults
            )
            stack.callback(grpc_sink.close)
            sink = grpc_sink
        transfer = None
        if config.role == "prefill":
            transfer = KvTransferServer(
                host=config.transfer_host,
                port=config.transfer_port,
                session_ttl=config.kv_session_timeout_s,
                bootstrap_timeout=config.bootstrap_timeout_s,
                protocol="tcp",
            )
            try:
                await stack.enter_async_context(transfer)
            except OSError as err:
                where = f"--transfer-host {config.transfer_host} --transfer-port {config.transfer_port}"
                raise BindError(f"{where}: cannot listen for KV transfers: {err.strerror or err}") from None
        engine = MockEngine(
            config, kv_sink=sink, ground_truth=ground_truth, transfer=transfer, exit_process=exit_process
        )
        if isinstance(sink, GrpcKvEvents):
            for cache in engine.caches:
                sink.attach_cache(cache)
        await stack.enter_async_context(engine.serving())
        services = [SimulatedControl(engine), SimulatedInference(engine)]
        running = await stack.enter_async_context(open_server(services, config.listen))
        # Runs first on exit: handlers cancelled by the server's shutdown are not client cancels.
        stack.callback(setattr, engine, "closing", True)
        address = str(running.address)
        engine.set_address(address)
        if isinstance(sink, GrpcKvEvents):
            addr = running.address
            sink.advertise_host = addr.host or address
            sink.advertise_port = addr.port or 0
        kv_endpoints: tuple[str, ...] = ()
        if sink is not None:
            kv_endpoints = tuple(
                f"{s.transport}://{s.endpoint_addr.host}:{s.endpoint_addr.port}"
                for s in sink.sources().sources
                if s.endpoint_addr is not None
            )
        info = ServingInfo(
            address=address,
            flavor=config.flavor,
            role=config.role,
            instance_id=engine.instance_id,
            kv_events=transport,
            kv_endpoints=kv_endpoints,
            transfer_endpoint=f"{transfer.host}:{transfer.port}" if transfer is not None else "",
        )
        engine.start()
        yield engine, info


async def serve_engine(
    config: EngineConfig,
    *,
    stop: object,
    on_ready: Callable[[ServingInfo], None] | None = None,
    exit_process: Callable[[int], None] | None = None,
    hang_signals: bool = False,
) -> None:
    """Serve until ``stop`` (an ``asyncio.Event``) is set, then shut down.

    Calls ``on_ready`` once serving, then logs :func:`serving_line`. ``hang_signals``: SIGUSR1 /
    SIGUSR2 flip the engine's hang switches (``sidecar/mock/hangs.py``; the CLI sets it).
    """
    async with open_engine(config, exit_process=exit_process) as (engine, info):
        if hang_signals:
            engine.hangs.install_signals(asyncio.get_running_loop())
        if on_ready is not None:
            on_ready(info)
        log.info("%s", serving_line(info))
        await stop.wait()  # type: ignore[attr-defined]


def serving_line(info: ServingInfo) -> str:
    """The one log line of a serving engine (launchers match ``serving OpenEngine on (\\S+)``)."""
    kv = " ".join(info.kv_endpoints)
    transfer = f"; kv transfer on {info.transfer_endpoint}" if info.transfer_endpoint else ""
    return (
        f"mock {info.flavor} engine ({info.role}) serving OpenEngine on {info.address}; "
        f"kv events {info.kv_events} {kv}{transfer}"
    )
