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
from collections.abc import AsyncIterator, Callable
from typing import Any

from sidecar.engines.common.app import instance_id, serve_until_stopped, serving
from sidecar.engines.sglang.config import SglangSettings, apply_env, engine_kwargs, kv_endpoints
from sidecar.engines.sglang.discovery import discover
from sidecar.engines.sglang.engine import SglangEngine
from sidecar.engines.sglang.stream import run_request
from sidecar.mock.app import ServingInfo

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
        instance = instance_id(settings, "sglang")
        init = sgl._scheduler_init_result.scheduler_infos[0]  # the scheduler's start-up report
        discovery = discover(
            tm.server_args, tm.model_config, tm.tokenizer, init, snapshot, settings, kv, instance_id=instance
        )
        engine = SglangEngine(sgl, discovery)
        engine.snapshot = snapshot
        engine.children = _children()
        refresher = asyncio.ensure_future(_refresh(engine))
        try:
            async with serving(engine, run_request, settings, kv, flavor="sglang", instance=instance) as info:
                yield engine, info
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


def _describe(engine: SglangEngine) -> str:
    model = engine.discovery.model.served_model_name
    return f"sglang engine (aggregated, model {model}, page size {engine.discovery.page_size})"


async def serve_sglang(
    settings: SglangSettings, *, stop: Any, on_ready: Callable[[ServingInfo], None] | None = None
) -> None:
    """Serve until ``stop`` (an ``asyncio.Event``) is set; ``on_ready`` once serving."""
    await serve_until_stopped(
        open_sglang_engine(settings), stop=stop, on_ready=on_ready, log=log, describe=_describe
    )
