"""What every adapter's process wiring shares: the OpenEngine server in front of a started engine.

An adapter starts its engine, builds its discovery and its :class:`AdapterEngine` subclass, then
serves it with :func:`serving` (inside its own ``open_*_engine`` context); its ``serve_*`` entry
point is :func:`serve_until_stopped`. asyncio, one event loop.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

from sidecar.engines.common.net import KvEndpoints
from sidecar.engines.common.registry import Active
from sidecar.engines.common.services import ControlService, InferenceService, Send, ServedEngine
from sidecar.engines.common.settings import AdapterSettings
from sidecar.mock.app import ServingInfo
from sidecar.openengine.serving.grpc_server import open_server

RunRequest = Callable[[Any, Active, Send], Awaitable[None]]


class ShutdownEngine(ServedEngine, Protocol):
    """An adapter's engine as the server needs it: the services' view, and its shutdown."""

    async def shutdown(self) -> None: ...


def instance_id(settings: AdapterSettings, flavor: str) -> str:
    """``--instance-id``, else ``FLAVOR-`` and 12 random hex digits."""
    return settings.instance_id or f"{flavor}-{uuid.uuid4().hex[:12]}"


@contextlib.asynccontextmanager
async def serving(
    engine: ShutdownEngine,
    run_request: RunRequest,
    settings: AdapterSettings,
    kv: KvEndpoints | None,
    *,
    flavor: str,
    instance: str,
) -> AsyncIterator[ServingInfo]:
    """Serve ``engine``'s ``Control`` and ``Inference`` on ``settings.listen``; yields the ready
    information (as ``mock-engine`` writes it) once the server listens.

    On exit the server stops first (its handlers are cancelled: their requests are aborted in
    the engine), then ``engine.shutdown()`` aborts what is left. Raises OSError when the address
    cannot be bound.
    """
    services = [ControlService(engine), InferenceService(engine, run_request)]
    try:
        async with open_server(services, settings.listen) as running:
            yield ServingInfo(
                address=str(running.address),
                flavor=flavor,
                role="aggregated",
                instance_id=instance,
                kv_events="zmq" if kv is not None else "none",
                kv_endpoints=(f"tcp://{kv.host}:{kv.port}",) if kv is not None else (),
                transfer_endpoint="",
            )
    finally:
        await engine.shutdown()


async def serve_until_stopped(
    opened: contextlib.AbstractAsyncContextManager[tuple[Any, ServingInfo]],
    *,
    stop: Any,
    on_ready: Callable[[ServingInfo], None] | None,
    log: logging.Logger,
    describe: Callable[[Any], str],
) -> None:
    """Serve ``opened`` (an adapter's ``open_*_engine``) until ``stop`` (an ``asyncio.Event``) is
    set; ``on_ready`` once serving, then one log line: ``describe(engine)``, the address and the
    KV event endpoints."""
    async with opened as (engine, info):
        if on_ready is not None:
            on_ready(info)
        log.info(
            "%s serving OpenEngine on %s; kv events %s %s",
            describe(engine),
            info.address,
            info.kv_events,
            " ".join(info.kv_endpoints),
        )
        await stop.wait()
