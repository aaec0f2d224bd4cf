"""The benchmark's processes: the simulated engine, the sidecar, and client workers.

Each runs as its own ``python`` process so its CPU and memory can be read from
``/proc`` and nothing shares an interpreter with what it measures. Readiness is the log
line each prints once serving (never a sleep); stderr is pumped continuously (kept as the
last lines, for error messages). Leaving a context terminates (then kills) what runs.

Errors: :class:`BenchError` (a process died, a readiness line never came, a worker failed).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from sidecar.childproc import (
    ENGINE_READY,
    SIDECAR_READY,
    ChildLineTimeout,
    ChildProcess,
    loopback_run_args,
    spawn_child,
)

#: GetLoad metadata for the engine's full ground truth (see ``engine_proc.lean_load_attributes``).
REPORT_FULL = ("mock-report", "full")


class BenchError(Exception):
    """A benchmark process failed; the message carries the tail of its log."""


#: A benchmark child process (its last 400 log lines are kept).
Proc = ChildProcess


@asynccontextmanager
async def spawn(name: str, argv: list[str], env: dict[str, str] | None = None) -> AsyncIterator[Proc]:
    """Run ``argv`` (``env`` added to ours) with its stderr collected; SIGTERM (then SIGKILL
    after 15 s) on exit."""
    async with spawn_child(argv, name=name, env=env, term_timeout=15, keep_lines=400) as proc:
        yield proc


async def wait_ready(proc: Proc, pattern: re.Pattern[str]) -> re.Match[str]:
    """The readiness line of ``proc`` (60 s at most), else :class:`BenchError`."""
    try:
        return await proc.wait_for_line(pattern, timeout=60)
    except ChildLineTimeout as err:
        raise BenchError(str(err)) from None


@dataclass(frozen=True)
class EngineOptions:
    """How the simulated engine is started (``mock-engine`` flags)."""

    model: str = "bench-model"
    flavor: str = "vllm"
    max_concurrent_streams: int = 65536  # 0: grpclib's default of 100 per connection
    lean_load_attributes: bool = True  # see engine_proc.lean_load_attributes
    capacity: int = 20_000  # max running (and queued) requests
    #: Pace every stream at this many ms per token (0: fast mode, as fast as it can).
    token_delay_ms: float = 0.0


@asynccontextmanager
async def engine(tmp: Path, opts: EngineOptions) -> AsyncIterator[tuple[Proc, str]]:
    """A fast-mode simulated engine on a Unix socket; yields (proc, address)."""
    sock = tmp / "engine.sock"
    argv = [sys.executable, "-m", "sidecar.bench.engine_proc"]
    if opts.max_concurrent_streams:
        argv += ["--max-concurrent-streams", str(opts.max_concurrent_streams)]
    if opts.lean_load_attributes:
        argv += ["--lean-load-attributes"]
    pace = ["--token-delay-ms", str(opts.token_delay_ms)] if opts.token_delay_ms else ["--fast"]
    argv += [*pace, "--flavor", opts.flavor, "--model", opts.model, "--kv-events", "none"]
    argv += ["--listen", f"unix://{sock}", "--max-running", str(opts.capacity)]
    argv += ["--max-queue", str(opts.capacity), "--total-kv-blocks", str(opts.capacity * 40)]
    argv += ["--max-output-tokens", "1000000", "--orphans", "hold", "--orphan-timeout", "3600"]
    async with spawn("engine", argv) as proc:
        m = await wait_ready(proc, ENGINE_READY)
        yield proc, m.group(1)


@dataclass
class SidecarProcess:
    proc: Proc
    ws: str
    http: str


@asynccontextmanager
async def sidecar(
    engine_address: str, *extra: str, command: Sequence[str] = (), env: dict[str, str] | None = None
) -> AsyncIterator[SidecarProcess]:
    """``openengine-sidecar run`` in front of the engine, on ephemeral ports, high stream limits.

    ``command`` replaces ``python -m sidecar`` (e.g. a script that patches the sidecar before
    running its CLI, to measure a change against the same anchors)."""
    argv = [*(command or (sys.executable, "-m", "sidecar")), *loopback_run_args(engine_address)]
    argv += ["--max-streams", "50000", "--max-streams-per-connection", "50000", *extra]
    async with spawn("sidecar", argv, env) as proc:
        m = await wait_ready(proc, SIDECAR_READY)
        yield SidecarProcess(proc, m.group(1), m.group(2))


async def run_worker(
    spec: dict[str, Any],
    *,
    timeout: float = 600,
    on_armed: Callable[[dict[str, Any]], Awaitable[None]] | None = None,
) -> dict[str, Any]:
    """Run one client worker (``sidecar.bench.worker``) to its result; ``on_armed`` runs when
    the worker reports ``armed`` (it continues once that returns)."""
    argv = [sys.executable, "-m", "sidecar.bench.worker", json.dumps(spec)]
    process = await trio.lowlevel.open_process(
        argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    errlog = Proc(f"worker {spec['mode']}", process, keep_lines=400)
    result: dict[str, Any] | None = None
    error: str | None = None
    try:
        with trio.move_on_after(timeout) as deadline:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(errlog.pump)
                assert process.stdout is not None and process.stdin is not None
                buf = b""
                async for chunk in process.stdout:
                    buf += chunk
                    *lines, buf = buf.split(b"\n")
                    for line in lines:
                        msg = json.loads(line)
                        if msg["event"] == "armed":
                            if on_armed is not None:
                                await on_armed(msg)
                            await process.stdin.send_all(b"go\n")
                        elif msg["event"] == "error":
                            error = f"{msg['message']}\n{msg.get('trace', '')}"
                        elif msg["event"] == "result":
                            result = msg
                await process.wait()
    finally:
        with trio.CancelScope(shield=True):
            if process.returncode is None:
                process.kill()
                await process.wait()
    if deadline.cancelled_caught:
        raise BenchError(f"worker {spec['mode']} timed out after {timeout:.0f}s; log:\n{errlog.tail()}")
    if error is not None:
        raise BenchError(f"worker {spec['mode']}: {error}")
    if result is None:
        raise BenchError(
            f"worker {spec['mode']} exited {process.returncode} without a result:\n{errlog.tail()}"
        )
    result.pop("event", None)
    return result


# --- the engine's ground truth -------------------------------------------------------------------------


async def engine_counters(address: str, *, cancel_times: bool = False) -> dict[str, Any]:
    """The simulated engine's counters (``GetLoad.attributes``); needs a trio-asyncio loop."""
    from sidecar.mock.services import REPORT_CANCEL_TIMES
    from sidecar.openengine.client import open_engine_client

    async with open_engine_client(address) as client:
        with trio.fail_after(30):
            load = await client.get_load(metadata=[REPORT_CANCEL_TIMES if cancel_times else REPORT_FULL])
    assert load.attributes is not None
    out: dict[str, Any] = load.attributes.to_dict()
    return out


async def abort_everything(address: str) -> None:
    """``Abort{all_requests}`` on the engine (clears what a scenario leaked, so the next starts clean)."""
    from sidecar.openengine import pb
    from sidecar.openengine.client import open_engine_client

    async with open_engine_client(address) as client:
        with trio.fail_after(30):
            await client.abort(pb.AbortRequest(all_requests=pb.AllRequests()))


async def wait_engine_idle(address: str, timeout: float = 30) -> tuple[bool, dict[str, Any]]:
    """Poll until the engine has no stream open and nothing in flight; (idle?, counters)."""
    counters: dict[str, Any] = {}
    with trio.move_on_after(timeout):
        while True:
            counters = await engine_counters(address)
            if counters["streams_open"] == 0 and counters["requests_in_flight"] == 0:
                return True, counters
            await trio.sleep(0.1)
    return False, counters
