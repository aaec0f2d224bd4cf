"""Wiring of one ``sglang-engine`` process: SGLang's ``Engine`` in process, discovery, the OpenEngine server.

:func:`serve_sglang` is the asyncio entry point (``asyncio.run`` in the command). Start-up
order: the environment (offline), the KV publisher's ports, SGLang's ``Engine`` (it starts its
scheduler and detokenizer processes, the scheduler with the ZMQ publisher, and runs its
tokenizer manager on this event loop), discovery from the resolved configuration, then the
gRPC server. Shutdown runs backwards: the server stops (its handlers are cancelled: their
requests are aborted in SGLang), then SGLang's processes are shut down.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from sidecar.engines.common.services import ControlService, InferenceService
from sidecar.engines.sglang.config import SglangSettings, apply_env, engine_kwargs, kv_endpoints
from sidecar.engines.sglang.discovery import discover
from sidecar.engines.sglang.engine import SglangEngine
from sidecar.engines.sglang.stream import run_request
from sidecar.mock.app import ServingInfo
from sidecar.openengine.serving.grpc_server import open_server

log = logging.getLogger(__name__)
#: How often SGLang's load snapshot is read for GetLoad (a shared-memory read).
LOAD_REFRESH = 0.25
FIRST_SNAPSHOT_TIMEOUT = 60.0


@contextlib.asynccontextmanager
async def open_sglang_engine(settings: SglangSettings) -> AsyncIterator[tuple[SglangEngine, ServingInfo]]:
    """Start SGLang and serve OpenEngine; yields once the gRPC server listens.

    Resources: SGLang's scheduler and detokenizer processes (the scheduler with the ZMQ
    publisher), the gRPC listener, a task reading SGLang's load snapshot. All are closed on
    exit, the server first. Raises OSError when the address cannot be bound; SGLang's own
    errors when the model cannot be loaded.
    """
    apply_env(settings)
    from sglang.srt.entrypoints.engine import Engine

    kv = kv_endpoints(settings) if settings.kv_events else None
    sgl = Engine(**engine_kwargs(settings, kv))
    try:
        tm = sgl.tokenizer_manager
        tm.auto_create_handle_loop()  # SGLang's output loop, on this event loop
        snapshot = await _first_snapshot(tm)
        instance = settings.instance_id or f"sglang-{uuid.uuid4().hex[:12]}"
        init = sgl._scheduler_init_result.scheduler_infos[0]  # the scheduler's start-up report
        discovery = discover(
            tm.server_args, tm.model_config, tm.tokenizer, init, snapshot, settings, kv, instance_id=instance
        )
        engine = SglangEngine(sgl, discovery)
        engine.snapshot = snapshot
        engine.children = _children()
        refresher = asyncio.ensure_future(_refresh(engine))
        try:
            services = [ControlService(engine), InferenceService(engine, run_request)]
            try:
                async with open_server(services, settings.listen) as running:
                    endpoints = (f"tcp://{kv.host}:{kv.port}",) if kv is not None else ()
                    info = ServingInfo(
                        address=str(running.address),
                        flavor="sglang",
                        role="aggregated",
                        instance_id=instance,
                        kv_events="zmq" if kv is not None else "none",
                        kv_endpoints=endpoints,
                        transfer_endpoint="",
                    )
                    yield engine, info
            finally:
                await engine.shutdown()
        finally:
            refresher.cancel()
    finally:
        sgl.shutdown()


async def _first_snapshot(tm: Any) -> Any:
    """SGLang's first published load snapshot (its scheduler publishes one within a second of
    starting; bounded: SGLang's own error if none comes)."""
    async with asyncio.timeout(FIRST_SNAPSHOT_TIMEOUT):
        while True:
            loads = await tm.get_loads()
            if loads and loads[0].max_running_requests > 0:
                return loads[0]
            await asyncio.sleep(0.1)


def _children() -> list[Any]:
    import multiprocessing

    return [p for p in multiprocessing.active_children() if "resource_tracker" not in p.name]


async def _refresh(engine: SglangEngine) -> None:
    while True:
        await engine.refresh()
        await asyncio.sleep(LOAD_REFRESH)


async def serve_sglang(
    settings: SglangSettings, *, stop: Any, on_ready: Callable[[ServingInfo], None] | None = None
) -> None:
    """Serve until ``stop`` (an ``asyncio.Event``) is set; ``on_ready`` once serving."""
    async with open_sglang_engine(settings) as (engine, info):
        if on_ready is not None:
            on_ready(info)
        model = engine.discovery.model
        log.info(
            "sglang engine (aggregated, model %s, page size %s) serving OpenEngine on %s; kv events %s %s",
            model.served_model_name,
            engine.discovery.page_size,
            info.address,
            info.kv_events,
            " ".join(info.kv_endpoints),
        )
        await stop.wait()
