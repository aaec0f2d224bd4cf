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
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from sidecar.engines.common.services import ControlService, InferenceService
from sidecar.engines.vllm.config import VllmSettings, apply_env, engine_args, kv_endpoints
from sidecar.engines.vllm.discovery import discover
from sidecar.engines.vllm.engine import SchedulerStatsSink, VllmEngine
from sidecar.engines.vllm.stream import run_request
from sidecar.mock.app import ServingInfo
from sidecar.openengine.serving.grpc_server import open_server

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
        instance = settings.instance_id or f"vllm-{uuid.uuid4().hex[:12]}"
        discovery = discover(llm.vllm_config, llm.get_tokenizer(), settings, kv, instance_id=instance)
        engine = VllmEngine(llm, discovery, stats)
        services = [ControlService(engine), InferenceService(engine, run_request)]
        try:
            async with open_server(services, settings.listen) as running:
                endpoints = (f"tcp://{kv.host}:{kv.port}",) if kv is not None else ()
                info = ServingInfo(
                    address=str(running.address),
                    flavor="vllm",
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
        llm.shutdown()


async def serve_vllm(
    settings: VllmSettings, *, stop: Any, on_ready: Callable[[ServingInfo], None] | None = None
) -> None:
    """Serve until ``stop`` (an ``asyncio.Event``) is set; ``on_ready`` once serving."""
    async with open_vllm_engine(settings) as (engine, info):
        if on_ready is not None:
            on_ready(info)
        model = engine.discovery.model
        log.info(
            "vllm engine (aggregated, model %s, block size %s) serving OpenEngine on %s; kv events %s %s",
            model.served_model_name,
            engine.discovery.server.capacity.kv_block_size if engine.discovery.server.capacity else "?",
            info.address,
            info.kv_events,
            " ".join(info.kv_endpoints),
        )
        await stop.wait()
