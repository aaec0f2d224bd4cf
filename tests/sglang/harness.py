"""Real SGLang for the end-to-end tests: ``sglang-engine`` processes on the tiny model, their load.

An engine start costs 15-100 s on this machine (SGLang imports torch in three processes), so the
engine is a session fixture (``conftest.py``) shared by every test: :func:`start_engine` runs
``python -m sidecar sglang-engine`` on a Unix socket (``tests.real_engines.start_adapter``: its
ready file polled, bounded, its output in a log file; ``stop`` ends the whole process group).
Tests must use their own request ids and prompts: the engine and its radix cache are shared.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from tests.prereq import require_module
from tests.real_engines import MODEL, EngineProc, start_adapter, wait_idle

PAGE = 16
MAX_TOTAL_TOKENS = 16384
CONTEXT = 8192
#: SGLang's own counts of the requests it holds (``GetLoad`` attributes): 0 once it is idle.
IDLE = ("sglang_held_requests", "sglang_running", "sglang_waiting")


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


async def wait_request_gone(address: str, timeout: float = 15) -> dict[str, Any]:
    """Once SGLang holds no request (its tokenizer manager's table, its scheduler's running and
    waiting counts) and the adapter has none in flight: the adapter's attributes then."""
    return await wait_idle(address, IDLE, timeout)
