"""Real processes for end-to-end tests: a simulated engine and the sidecar, on real sockets.

Both are started as ``python -m sidecar ...`` subprocesses; readiness is the log line each
prints once it is serving (read from its stderr, never a sleep). Their logs are kept for
assertions (``proc.lines``). Leaving the context terminates (then kills) what is still running.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Iterable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from sidecar.childproc import ENGINE_READY, SIDECAR_READY, ChildProcess, loopback_run_args, spawn_child
from sidecar.openengine import pb
from sidecar.openengine.client import open_engine_client
from sidecar.openengine.message_limits import EngineLimits
from tests.polling import eventually  # re-exported: the e2e tests' polling helper

__all__ = ["ENGINE_READY", "SIDECAR_READY", "Proc"]  # re-exported for the tests

#: A child process with its stderr lines (see :mod:`sidecar.childproc`).
Proc = ChildProcess


@asynccontextmanager
async def spawn_argv(
    argv: list[str], env: dict[str, str] | None = None, *, label: str = ""
) -> AsyncIterator[Proc]:
    """Run ``argv`` with stderr captured (its log is printed if the body fails); on exit
    SIGTERM, then kill after 10 s."""

    def print_log(child: Proc) -> None:
        print(f"--- log of {child.name} (last 60 lines) ---\n" + child.tail(60))

    async with spawn_child(argv, name=label or argv[0], env=env, on_error=print_log) as proc:
        yield proc


def spawn(args: list[str], *, env: dict[str, str] | None = None) -> Any:
    """``python -m sidecar ARGS`` (see :func:`spawn_argv`)."""
    return spawn_argv([sys.executable, "-m", "sidecar", *args], env, label=" ".join(args[:1]))


@dataclass
class Engine:
    proc: Proc
    address: str


@asynccontextmanager
async def mock_engine(tmp_path: Path, *args: str, name: str = "engine") -> AsyncIterator[Engine]:
    """A simulated engine on a Unix socket under ``tmp_path`` (args: mock-engine flags).

    ``--orphans hold`` unless ``args`` say otherwise: a missing Abort then shows in the
    engine's counters (``requests_leaked``)."""
    sock = tmp_path / f"{name}.sock"
    async with spawn(["mock-engine", "--listen", f"unix://{sock}", "--orphans", "hold", *args]) as proc:
        m = await proc.wait_for_line(ENGINE_READY)
        yield Engine(proc, m.group(1).rstrip(";"))


@dataclass
class Sidecar:
    proc: Proc
    ws: str
    http: str


@asynccontextmanager
async def sidecar(engine_address: str, *args: str) -> AsyncIterator[Sidecar]:
    """``openengine-sidecar run`` in front of ``engine_address`` on ephemeral ports."""
    async with spawn([*loopback_run_args(engine_address), *args]) as proc:
        m = await proc.wait_for_line(SIDECAR_READY)
        yield Sidecar(proc, m.group(1), m.group(2))


@asynccontextmanager
async def open_together(*managers: AbstractAsyncContextManager[Any]) -> AsyncIterator[list[Any]]:
    """Enter ``managers`` concurrently (each in its own task: starting processes in parallel)
    and yield what each gave, in order; on leaving, all are exited concurrently. If one fails
    to start, the others are exited and its error propagates."""
    values: list[Any] = [None] * len(managers)
    started = [trio.Event() for _ in managers]
    leave = trio.Event()

    async def hold(i: int, manager: AbstractAsyncContextManager[Any]) -> None:
        async with manager as value:
            values[i] = value
            started[i].set()
            await leave.wait()

    async with trio.open_nursery() as nursery:
        for i, manager in enumerate(managers):
            nursery.start_soon(hold, i, manager)
        for event in started:
            await event.wait()
        try:
            yield values
        finally:
            leave.set()


async def engine_counters(address: str) -> dict[str, Any]:
    """The simulated engine's ground-truth counters (``GetLoad.attributes``), whatever the
    answer's size (fault ``oversized-answer``). Needs ``aio_loop``."""
    async with open_engine_client(address, limits=EngineLimits(max_answer_bytes=1 << 30)) as client:
        with trio.fail_after(5):
            load = await client.get_load()
    assert load.attributes is not None
    return load.attributes.to_dict()


async def counters_once_aborted(address: str, request_ids: Iterable[str]) -> dict[str, Any] | None:
    """The engine's counters once each of ``request_ids`` got an Abort, else None (a predicate
    for :func:`eventually`: an Abort still queued for a slot when its client got the end is
    sent in the background, so the engine can go idle before it arrives)."""
    counters = await engine_counters(address)
    by_id = counters["aborts_received_by_id"]
    return counters if all(by_id.get(rid, 0) >= 1 for rid in request_ids) else None


async def wait_engine_idle(address: str, timeout: float = 10) -> dict[str, Any]:
    """Counters once the engine has no stream open and nothing in flight."""

    async def idle() -> dict[str, Any] | None:
        c = await engine_counters(address)
        return c if c["streams_open"] == 0 and c["requests_in_flight"] == 0 else None

    result: dict[str, Any] = await eventually(idle, timeout)
    return result


def generate_request(prompt: str = "Hello world", max_tokens: int = 8, **extra: Any) -> dict[str, Any]:
    """A north ``request`` object (proto3 JSON of GenerateRequest)."""
    stopping = {"maxTokens": max_tokens, "ignoreEos": True}  # exactly max_tokens tokens: deterministic length
    req: dict[str, Any] = {"model": "Qwen/Qwen3-0.6B", "prompt": prompt, "stopping": stopping}
    req.update(extra)
    return req


__all__ = [
    "Engine",
    "Proc",
    "Sidecar",
    "engine_counters",
    "eventually",
    "generate_request",
    "mock_engine",
    "open_together",
    "pb",
    "sidecar",
    "spawn",
]
