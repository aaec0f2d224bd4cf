"""Real SGLang for the end-to-end tests: ``sglang-engine`` processes on the tiny model, their load.

An engine start costs 15-100 s on this machine (SGLang imports torch in three processes), so the
engine is a session fixture (``conftest.py``) shared by every test: :func:`start_engine` runs
``python -m sidecar sglang-engine`` on a Unix socket (``tests.vllm.harness.start_adapter``: its
ready file polled, bounded, its output in a log file; ``stop`` ends the whole process group).
Tests must use their own request ids and prompts: the engine and its radix cache are shared.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from tests.e2e.harness import eventually
from tests.prereq import require_module
from tests.vllm.harness import EngineProc, engine_load, start_adapter

MODEL = "tiny-llama"
PAGE = 16
MAX_TOTAL_TOKENS = 16384
CONTEXT = 8192


def require_sglang() -> None:
    """Skip locally without the ``sglang`` extra; fail under CI (scripts/test installs it)."""
    require_module("sglang", "scripts/install-sglang")


def engine_env() -> dict[str, str]:
    """Quieter logs, and SGLang's compute on one core (the other for the sidecar and the test)."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "SGLANG_LOGGING_LEVEL": "WARNING", "PYTHONUNBUFFERED": "1"}


def start_engine(model: Path, tmp: Path, name: str, *args: str) -> EngineProc:
    """``sglang-engine`` on ``unix://tmp/NAME.sock``; returns once it serves (raises with its log if not)."""
    argv = [
        "sglang-engine",
        "--model",
        str(model),
        "--listen",
        f"unix://{tmp / (name + '.sock')}",
        "--served-model-name",
        MODEL,
        "--dtype",
        "float32",
        "--page-size",
        str(PAGE),
        "--max-total-tokens",
        str(MAX_TOTAL_TOKENS),
        "--instance-id",
        name,
        *args,
    ]
    return start_adapter(argv, model, tmp, name, engine_env())


async def attributes(address: str) -> dict[str, Any]:
    load = await engine_load(address)
    assert load.attributes is not None
    return load.attributes.to_dict()


async def wait_request_gone(address: str, timeout: float = 15) -> dict[str, Any]:
    """Once SGLang holds no request (its tokenizer manager's table, its scheduler's running and
    waiting counts) and the adapter has none in flight: the adapter's attributes then."""

    async def gone() -> dict[str, Any] | None:
        load = await engine_load(address)
        attrs = load.attributes.to_dict() if load.attributes is not None else {}
        idle = attrs["sglang_held_requests"] == 0 and attrs["sglang_running"] == 0
        idle = idle and attrs["sglang_waiting"] == 0
        held = (load.running_requests or 0) + (load.queued_requests or 0) + attrs["in_flight"]
        return attrs if idle and held == 0 else None

    result: dict[str, Any] = await eventually(gone, timeout, interval=0.05)
    return result
