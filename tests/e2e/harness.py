"""Real processes for end-to-end tests: a simulated engine and the sidecar, on real sockets.

Both are started as ``python -m sidecar ...`` subprocesses; readiness is the log line each
prints once it is serving (read from its stderr, never a sleep). Their logs are kept for
assertions (``proc.lines``). Leaving the context terminates (then kills) what is still running.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from sidecar.openengine import pb
from sidecar.openengine.client import open_engine_client

ENGINE_READY = re.compile(r"serving OpenEngine on (\S+)")
SIDECAR_READY = re.compile(r"serving (ws://\S+) and (http://\S+)")


@dataclass
class Proc:
    """A child process with its stderr lines collected as they arrive."""

    process: trio.Process
    lines: list[str] = field(default_factory=list)
    _changed: trio.Event = field(default_factory=trio.Event)

    async def wait_for_line(self, pattern: re.Pattern[str], timeout: float = 20) -> re.Match[str]:
        """Return the first log line matching ``pattern`` (waiting for it), or fail with the log."""
        with trio.move_on_after(timeout):
            seen = 0
            while True:
                for line in self.lines[seen:]:
                    if m := pattern.search(line):
                        return m
                seen = len(self.lines)
                if self.process.returncode is not None:
                    break
                await self._changed.wait()
        raise AssertionError(f"no line matching {pattern.pattern!r}; log:\n" + "\n".join(self.lines[-40:]))

    async def _pump(self) -> None:
        assert self.process.stderr is not None
        buf = b""
        async for chunk in self.process.stderr:
            buf += chunk
            *done, buf = buf.split(b"\n")
            self.lines.extend(d.decode(errors="replace") for d in done)
            self._changed.set()
            self._changed = trio.Event()
        if buf:
            self.lines.append(buf.decode(errors="replace"))
        self._changed.set()

    def signal(self, sig: int) -> None:
        self.process.send_signal(sig)

    async def wait(self, timeout: float = 30) -> int:
        with trio.fail_after(timeout):
            return await self.process.wait()


@asynccontextmanager
async def spawn_argv(
    argv: list[str], env: dict[str, str] | None = None, *, label: str = ""
) -> AsyncIterator[Proc]:
    """Run ``argv`` with stderr captured (its log is printed if the body fails); on exit
    SIGTERM, then kill after 10 s."""
    process = await trio.lowlevel.open_process(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
    )
    proc = Proc(process)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(proc._pump)
        try:
            yield proc
        except BaseException:
            print(f"--- log of {label or argv[0]} (last 60 lines) ---\n" + "\n".join(proc.lines[-60:]))
            raise
        finally:
            with trio.CancelScope(shield=True):
                if process.returncode is None:
                    process.send_signal(signal.SIGTERM)
                    with trio.move_on_after(10):
                        await process.wait()
                if process.returncode is None:
                    process.kill()
                    await process.wait()
            nursery.cancel_scope.cancel()


def spawn(args: list[str], *, env: dict[str, str] | None = None) -> Any:
    """``python -m sidecar ARGS`` (see :func:`spawn_argv`)."""
    return spawn_argv([sys.executable, "-m", "sidecar", *args], env, label=" ".join(args[:1]))


@dataclass
class Engine:
    proc: Proc
    address: str


@asynccontextmanager
async def mock_engine(tmp_path: Path, *args: str, name: str = "engine") -> AsyncIterator[Engine]:
    """A simulated engine on a Unix socket under ``tmp_path`` (args: mock-engine flags)."""
    sock = tmp_path / f"{name}.sock"
    async with spawn(["mock-engine", "--listen", f"unix://{sock}", *args]) as proc:
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
    async with spawn(
        [
            "run",
            "--engine",
            engine_address,
            "--listen",
            "127.0.0.1:0",
            "--http-listen",
            "127.0.0.1:0",
            "--kv-publish",
            "tcp://127.0.0.1:0",
            "--kv-replay",
            "tcp://127.0.0.1:0",
            *args,
        ]
    ) as proc:
        m = await proc.wait_for_line(SIDECAR_READY)
        yield Sidecar(proc, m.group(1), m.group(2))


async def engine_counters(address: str) -> dict[str, Any]:
    """The simulated engine's ground-truth counters (``GetLoad.attributes``). Needs ``aio_loop``."""
    async with open_engine_client(address) as client:
        with trio.fail_after(5):
            load = await client.get_load()
    assert load.attributes is not None
    return load.attributes.to_dict()


async def wait_engine_idle(address: str, timeout: float = 10) -> dict[str, Any]:
    """Counters once the engine has no stream open and nothing in flight."""

    async def idle() -> dict[str, Any] | None:
        c = await engine_counters(address)
        return c if c["streams_open"] == 0 and c["requests_in_flight"] == 0 else None

    result: dict[str, Any] = await eventually(idle, timeout)
    return result


async def eventually(check: Any, timeout: float = 10, interval: float = 0.05) -> Any:
    """Poll ``await check()`` until it returns a truthy value (state of another process, which
    offers no event to wait on); fail after ``timeout``."""
    with trio.fail_after(timeout):
        while not (result := await check()):  # noqa: ASYNC110 - polling another process, bounded
            await trio.sleep(interval)
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
    "generate_request",
    "mock_engine",
    "pb",
    "sidecar",
    "spawn",
]
