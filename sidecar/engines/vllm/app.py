"""Wiring of one ``vllm-engine`` process: vLLM's ``AsyncLLM``, discovery, the OpenEngine gRPC server.

:func:`serve_vllm` is the asyncio entry point (``asyncio.run`` in the command). Start-up order:
the environment (offline, no usage reporting, the CPU KV cache size), the KV publisher's
ports, ``AsyncLLM`` (vLLM starts its engine-core process and, with it, the ZMQ publisher),
discovery from the resolved configuration, then the gRPC server. Shutdown runs backwards:
the server stops (its handlers are cancelled: their requests are aborted in vLLM), then
the engine core is shut down.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from sidecar.engines.common.app import instance_id, serve_until_stopped, serving
from sidecar.engines.vllm.config import VllmSettings, apply_env, engine_args, kv_endpoints
from sidecar.engines.vllm.discovery import discover
from sidecar.engines.vllm.engine import SchedulerStatsSink, VllmEngine
from sidecar.engines.vllm.stream import run_request
from sidecar.mock.app import ServingInfo

log = logging.getLogger(__name__)


@contextlib.asynccontextmanager
async def open_vllm_engine(settings: VllmSettings) -> AsyncIterator[tuple[VllmEngine, ServingInfo]]:
    """Start vLLM and serve OpenEngine; yields once the gRPC server listens.

    Resources: vLLM's engine-core process (and its ZMQ publisher), the gRPC listener. Both are
    closed on exit, the server first. Raises OSError when the address cannot be bound; vLLM's
    own errors when the model cannot be loaded.
    """
    apply_env(settings)
    from vllm.v1.engine.async_llm import AsyncLLM

    kv = kv_endpoints(settings) if settings.kv_events else None
    stats = SchedulerStatsSink()
    llm = AsyncLLM.from_engine_args(engine_args(settings, kv), stat_loggers=[stats.factory])
    try:
        instance = instance_id(settings, "vllm")
        discovery = discover(llm.vllm_config, llm.get_tokenizer(), settings, kv, instance_id=instance)
        engine = VllmEngine(llm, discovery, stats)
        async with serving(engine, run_request, settings, kv, flavor="vllm", instance=instance) as info:
            yield engine, info
    finally:
        llm.shutdown()


def _describe(engine: VllmEngine) -> str:
    capacity = engine.discovery.server.capacity
    return (
        f"vllm engine (aggregated, model {engine.discovery.model.served_model_name}, "
        f"block size {capacity.kv_block_size if capacity else '?'})"
    )


async def serve_vllm(
    settings: VllmSettings, *, stop: Any, on_ready: Callable[[ServingInfo], None] | None = None
) -> None:
    """Serve until ``stop`` (an ``asyncio.Event``) is set; ``on_ready`` once serving."""
    await serve_until_stopped(
        open_vllm_engine(settings), stop=stop, on_ready=on_ready, log=log, describe=_describe
    )
