"""Child processes with their stderr read as it arrives: the one way the benchmark, the tests
and the launch helpers start the engine, the sidecar and friends as real processes.

Readiness is a log line the child prints once it serves (:meth:`ChildProcess.wait_for_line`),
never a sleep. Leaving :func:`spawn_child` sends SIGTERM, waits ``term_timeout`` seconds,
then kills; the wait is shielded, so a cancelled caller still reaps its child.

Errors: :class:`ChildLineTimeout` when a line never comes (or the child exits first); the
message carries the tail of the child's log.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import trio

#: The line ``mock-engine`` prints once serving; group 1 is its address.
ENGINE_READY = re.compile(r"serving OpenEngine on (\S+?);?(?:\s|$)")
#: The line ``openengine-sidecar run`` prints once serving; groups: WebSocket and HTTP URLs.
SIDECAR_READY = re.compile(r"serving (ws://\S+) and (http://\S+)")
#: The line ``run --openai-listen`` prints once its OpenAI front is bound; group 1 is its base URL.
OPENAI_READY = re.compile(r"OpenAI-compatible API on (https?://\S+)")


class ChildLineTimeout(Exception):
    """The awaited log line did not come in time (or the child closed its stderr first)."""


class ChildProcess:
    """A running child and the lines of its stderr so far (the last ``keep_lines``, if set)."""

    def __init__(self, name: str, process: trio.Process, keep_lines: int | None = None) -> None:
        self.name = name
        self.process = process
        self.lines: list[str] = []
        self._keep = keep_lines
        self._dropped = 0  # lines trimmed from the front so far
        self._changed = trio.Event()
        self._eof = False  # stderr closed: no more lines will come

    @property
    def pid(self) -> int:
        return self.process.pid

    def tail(self, n: int = 30) -> str:
        return "\n".join(self.lines[-n:])

    def signal(self, sig: int) -> None:
        self.process.send_signal(sig)

    async def wait(self, timeout: float = 30) -> int:
        """The exit status; ``trio.TooSlowError`` after ``timeout`` seconds."""
        with trio.fail_after(timeout):
            return await self.process.wait()

    async def wait_for_line(self, pattern: re.Pattern[str], timeout: float = 20) -> re.Match[str]:
        """The first line (from the start of the log) matching ``pattern``, waiting for it."""
        seen = 0  # absolute index of the next line to look at
        with trio.move_on_after(timeout):
            while True:
                for line in self.lines[max(0, seen - self._dropped) :]:
                    if m := pattern.search(line):
                        return m
                seen = self._dropped + len(self.lines)
                if self._eof or self.process.returncode is not None:
                    break
                await self._changed.wait()
        raise ChildLineTimeout(f"{self.name}: no line matching {pattern.pattern!r}; log:\n{self.tail(40)}")

    def _add(self, lines: list[str]) -> None:
        self.lines.extend(lines)
        if self._keep is not None and len(self.lines) > 2 * self._keep:
            cut = len(self.lines) - self._keep
            del self.lines[:cut]
            self._dropped += cut
        self._changed.set()
        self._changed = trio.Event()

    async def pump(self) -> None:
        """Collect the child's stderr until it closes (``spawn_child`` runs this for you)."""
        assert self.process.stderr is not None
        buf = b""
        async for chunk in self.process.stderr:
            buf += chunk
            *done, buf = buf.split(b"\n")
            if done:
                self._add([d.decode(errors="replace") for d in done])
        self._eof = True
        self._add([buf.decode(errors="replace")] if buf else [])


@asynccontextmanager
async def spawn_child(
    argv: list[str],
    *,
    name: str = "",
    env: dict[str, str] | None = None,
    term_timeout: float = 10,
    keep_lines: int | None = None,
    on_error: Callable[[ChildProcess], None] | None = None,
) -> AsyncIterator[ChildProcess]:
    """Run ``argv`` (stdout discarded, stderr collected, unbuffered Python) for the body.

    ``on_error`` is called with the child when the body raises (e.g. to print its log).
    """
    process = await trio.lowlevel.open_process(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
    )
    child = ChildProcess(name or os.path.basename(argv[0]), process, keep_lines)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(child.pump)
        try:
            yield child
        except BaseException:
            if on_error is not None:
                on_error(child)
            raise
        finally:
            await terminate(process, term_timeout)
            nursery.cancel_scope.cancel()


async def terminate(process: trio.Process, grace: float) -> None:
    """SIGTERM, up to ``grace`` seconds to exit, then SIGKILL; reaps it. Shielded: a cancelled
    caller still stops its child."""
    with trio.CancelScope(shield=True):
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
            with trio.move_on_after(grace):
                await process.wait()
        if process.returncode is None:
            process.kill()
            await process.wait()


def loopback_run_args(engine_address: str) -> list[str]:
    """``run`` flags for a sidecar in front of ``engine_address`` on ephemeral loopback ports."""
    return [
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
    ]
