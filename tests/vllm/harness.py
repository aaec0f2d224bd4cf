"""Real vLLM engines for the end-to-end tests: the tiny model, ``vllm-engine`` processes, their load.

An engine start costs 30-90 s of CPU on this machine, so the engines are session fixtures
(``conftest.py``) shared by every test: :func:`start_engine` runs ``python -m sidecar vllm-engine``
on a Unix socket (``tests.real_engines.start_adapter``: its ready file polled, bounded, its output
in a log file; ``stop`` ends the whole process group, vLLM's engine-core and workers included). Tests must use their own request ids and
prompts: the engines, and their prefix caches, are shared.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.prereq import require_module
from tests.real_engines import MODEL, START_TIMEOUT, EngineProc, start_adapter, stop_process_group, wait_idle

BLOCK = 32
KV_BLOCKS = 2048
#: The tiny model's full context: the conformance suite's "long" request is then 4,096 tokens
#: (its cap), which even this tiny model takes seconds to generate, several times the 3 s the
#: cancel checks allow a loaded machine to observe it running (1,792 tokens at 2,048 did not).
MAX_MODEL_LEN = 8192
#: vLLM's own counts of the requests it holds (``GetLoad`` attributes): 0 once it is idle.
IDLE = ("vllm_running", "vllm_waiting", "vllm_unfinished_requests")


def require_vllm() -> None:
    """Skip locally without the ``vllm`` extra; fail under CI (``scripts/test --all`` installs it)."""
    require_module("vllm", "scripts/install-vllm")


def engine_env(tmp: Path) -> dict[str, str]:
    """vLLM's caches under the test's directory, quieter logs, and its compute on CPU 0 only.

    vLLM's CPU backend binds an OpenMP thread to every core by default: on this 2-core test
    machine its inference then starved every other process — the test itself, the sidecar —
    for up to 20 s (a test timed out waiting for a log line that was already there; a drain
    finished before a late request could be sent). One core for the engine, one for the rest.
    """
    return {
        **os.environ,
        "VLLM_CPU_OMP_THREADS_BIND": "0",
        "VLLM_CACHE_ROOT": str(tmp / "vllm-cache"),
        "VLLM_LOGGING_LEVEL": "WARNING",
        "PYTHONUNBUFFERED": "1",
    }


def build_model(root: Path) -> Path:
    """The tiny model under ``root`` (built in a child process: the test process never imports torch)."""
    target = root / "tiny-llama"
    subprocess.run(
        [sys.executable, "-m", "sidecar.engines.vllm.tiny_model", str(target)],
        check=True,
        capture_output=True,
        env=engine_env(root),
        timeout=300,
    )
    return target


VllmProc = EngineProc


def start_engine(model: Path, tmp: Path, name: str, *args: str) -> EngineProc:
    """``vllm-engine`` on ``unix://tmp/NAME.sock``; returns once it serves (raises with its log if not)."""
    sock = tmp / f"{name}.sock"
    argv = [
        "vllm-engine",
        "--model",
        str(model),
        "--listen",
        f"unix://{sock}",
        "--served-model-name",
        MODEL,
        "--dtype",
        "float32",
        "--block-size",
        str(BLOCK),
        "--kv-cache-blocks",
        str(KV_BLOCKS),
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--instance-id",
        name,
        *args,
    ]
    return start_adapter(argv, model, tmp, name, engine_env(tmp))


async def wait_request_gone(address: str, timeout: float = 15) -> dict[str, Any]:
    """Once vLLM's own stats show nothing running or waiting and its frontend holds no request:
    the adapter's attributes then."""
    return await wait_idle(address, IDLE, timeout)


@dataclass
class VllmServe:
    """Stock vLLM's own OpenAI server (``vllm serve``) on the tiny model: the reference the
    sidecar's OpenAI front is compared with."""

    process: subprocess.Popen[bytes]
    url: str
    log: Path

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def stop(self, grace: float = 30.0) -> None:
        stop_process_group(self.process, grace)


def start_vllm_serve(model: Path, tmp: Path) -> VllmServe:
    """``vllm serve`` (its API server module: the ``vllm`` command looks for a distribution named
    vllm, the extra installs ``vllm-cpu``) with the engine settings ``start_engine`` gives
    ``vllm-engine`` (and ``vllm-engine``'s own defaults: eager, 20 logprobs, seed 0, 1 GiB KV);
    returns once ``/v1/models`` answers."""
    import socket

    import httpx

    from sidecar.engines.vllm.config import DEFAULT_ENV, VllmSettings, serve_argv

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp / "vllm-serve.log"
    settings = VllmSettings(
        model=str(model),
        served_model_names=(MODEL,),
        dtype="float32",
        block_size=BLOCK,
        kv_cache_blocks=KV_BLOCKS,
        max_model_len=MAX_MODEL_LEN,
    )
    argv = serve_argv(settings, sys.executable, port)
    env = {**engine_env(tmp), **DEFAULT_ENV, "VLLM_CPU_KVCACHE_SPACE": "1"}
    with log.open("wb") as log_fh:
        process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log_fh,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    serve = VllmServe(process, f"http://127.0.0.1:{port}/v1", log)
    started = time.monotonic()
    # another process with no readiness line of ours: poll its models endpoint, bounded
    while process.poll() is None and time.monotonic() - started < START_TIMEOUT:
        try:
            if httpx.get(serve.url + "/models", timeout=2).status_code == 200:
                return serve
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    serve.stop(5)
    raise RuntimeError(f"vllm serve did not start in {START_TIMEOUT:.0f} s:\n{serve.tail(60)}")
