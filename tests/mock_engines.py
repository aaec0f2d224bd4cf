"""Start simulated engines from trio tests.

Two helpers, both async context managers:

``run_mock_engine(tmp_path, flavor="vllm", role="aggregated", *, faults=(), listen=None,
timeout=30.0, args=(), env=None, **opts)`` → :class:`MockEngineProcess`
    A real subprocess (``python -m sidecar mock-engine``). ``opts`` become flags:
    ``dp_size=2`` → ``--dp-size 2``, ``fast=True`` → ``--fast``, ``lora=False`` →
    ``--no-lora``, a list/tuple repeats the flag (``alias=["a", "b"]``); ``faults``
    are ``--fault`` values (``["stall=2", "no-usage"]``); ``args`` are extra raw
    arguments. ``listen`` defaults to ``127.0.0.1:0``; ``listen="unix"`` picks a
    socket under ``tmp_path``. Waits (bounded by ``timeout``) for the engine's ready
    line — the gRPC socket is listening then; Health may still say STARTING with the
    ``slow-start`` fault. Raises :class:`MockEngineStartError` (with the engine's
    stderr) if it exits or times out first. On exit: SIGTERM, up to 5 s, then
    SIGKILL — also when the block is cancelled. The engine's stderr goes to
    ``<tmp_path>/mock-<flavor>-<role>-<n>.log`` (``.log_text()``).

``mock_engine_in_process(config=None, **fields)`` → :class:`InProcessEngine`
    The same engine inside this process's trio-asyncio loop (the test must take the
    ``aio_loop`` fixture). ``fields`` are :class:`~sidecar.mock.config.EngineConfig`
    fields (``flavor=``, ``role=``, ``max_running=``, ``faults=parse_faults([...])``).
    Faster to start; gives direct access to ``.engine`` (counters, caches). The
    ``crash-after`` fault raises :class:`EngineCrashed` in the engine instead of exiting.

Both start the engine with ``orphans="hold"`` unless told otherwise (the CLI's default is the
conformant ``release``): a request whose stream closed without Abort then stays running, so a
missing Abort shows in the counters (``requests_leaked``) instead of going unnoticed.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import trio
import trio_asyncio

from sidecar.childproc import terminate
from sidecar.mock.app import ServingInfo, open_engine
from sidecar.mock.command import ENV_PREFIX
from sidecar.mock.config import EngineConfig
from sidecar.mock.engine import MockEngine

__all__ = [
    "EngineCrashed",
    "InProcessEngine",
    "MockEngineProcess",
    "MockEngineStartError",
    "mock_engine_in_process",
    "run_mock_engine",
]

_counter = itertools.count(1)


class MockEngineStartError(RuntimeError):
    """The engine process exited or stayed silent before it was serving."""


class EngineCrashed(RuntimeError):
    """Raised inside an in-process engine by the ``crash-after`` fault."""


@dataclass
class MockEngineProcess:
    """A running engine subprocess. ``address`` works with ``open_engine_client``."""

    address: str
    info: dict[str, Any]
    process: trio.Process
    log_path: Path
    argv: list[str] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.process.pid

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def terminate(self) -> None:
        if self.process.returncode is None:
            self.process.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        if self.process.returncode is None:
            self.process.kill()

    async def wait(self) -> int:
        return await self.process.wait()


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _argv(flavor: str, role: str, listen: str, faults: Sequence[str], opts: Mapping[str, Any]) -> list[str]:
    argv = [
        sys.executable,
        "-m",
        "sidecar",
        "mock-engine",
        "--flavor",
        flavor,
        "--role",
        role,
        "--listen",
        listen,
    ]
    for spec in faults:
        argv += ["--fault", spec]
    for name, value in opts.items():
        if value is None:
            continue
        if value is True:
            argv.append(_flag(name))
        elif value is False:
            argv.append("--no-" + name.replace("_", "-"))
        elif isinstance(value, list | tuple):
            for v in value:
                argv += [_flag(name), str(v)]
        else:
            argv += [_flag(name), str(value)]
    argv += ["--ready-file", "-"]
    return argv


async def _read_ready_line(proc: trio.Process) -> dict[str, Any]:
    assert proc.stdout is not None
    buf = b""
    while b"\n" not in buf:
        chunk = await proc.stdout.receive_some(4096)
        if not chunk:
            raise MockEngineStartError("engine exited before it was serving")
        buf += chunk
    line = buf.split(b"\n", 1)[0]
    return json.loads(line)  # type: ignore[no-any-return]


async def _stop(proc: trio.Process, grace: float = 5.0) -> None:
    await terminate(proc, grace)
    with trio.CancelScope(shield=True):
        if proc.stdout is not None:
            await proc.stdout.aclose()


@asynccontextmanager
async def run_mock_engine(
    tmp_path: str | os.PathLike[str],
    flavor: str = "vllm",
    role: str = "aggregated",
    *,
    faults: Sequence[str] = (),
    listen: str | None = None,
    timeout: float = 30.0,
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    **opts: Any,
) -> AsyncIterator[MockEngineProcess]:
    """Run ``mock-engine`` as a subprocess for the block's duration (see the module doc)."""
    tmp = Path(tmp_path)
    n = next(_counter)
    if listen is None:
        listen = "127.0.0.1:0"
    elif listen == "unix":
        listen = f"unix://{tmp / f'mock-{n}.sock'}"
    opts.setdefault("orphans", "hold")  # the test bed's leak detector (module doc)
    argv = _argv(flavor, role, listen, faults, opts) + list(args)
    log_path = tmp / f"mock-{flavor}-{role}-{n}.log"
    child_env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
    child_env["PYTHONUNBUFFERED"] = "1"
    child_env.update(env or {})
    log_file = await trio.open_file(log_path, "wb")
    try:
        proc = await trio.lowlevel.open_process(
            argv, stdout=subprocess.PIPE, stderr=log_file.wrapped, stdin=subprocess.DEVNULL, env=child_env
        )
    finally:
        await log_file.aclose()
    try:
        try:
            with trio.fail_after(timeout):
                info = await _read_ready_line(proc)
        except (trio.TooSlowError, MockEngineStartError, ValueError) as err:
            await _stop(proc, grace=1.0)
            text = log_path.read_text(errors="replace")[-4000:]
            raise MockEngineStartError(
                f"mock engine {flavor}/{role} did not start ({type(err).__name__}: {err}); "
                f"exit status {proc.returncode}; argv {argv}; stderr:\n{text}"
            ) from None
        yield MockEngineProcess(str(info["address"]), info, proc, log_path, argv)
    finally:
        await _stop(proc)


@dataclass
class InProcessEngine:
    """An engine served inside this process (see :func:`mock_engine_in_process`)."""

    engine: MockEngine
    info: ServingInfo

    @property
    def address(self) -> str:
        return self.info.address

    @property
    def attributes(self) -> dict[str, Any]:
        """The ground-truth counters as ``GetLoad.attributes`` would report them."""
        return self.engine.load(False).attributes.to_dict()  # type: ignore[union-attr]


@asynccontextmanager
async def mock_engine_in_process(
    config: EngineConfig | None = None, **fields: Any
) -> AsyncIterator[InProcessEngine]:
    """Serve an engine in this process's trio-asyncio loop for the block's duration."""
    if config is None:
        fields.setdefault("orphans", "hold")  # the test bed's leak detector (module doc)
    cfg = replace(config or EngineConfig(), **fields)
    started = trio.Event()
    holder: dict[str, Any] = {}

    def crash(status: int) -> None:
        raise EngineCrashed(f"fault crash-after: the engine would exit with status {status}")

    async def serve() -> None:
        stop = asyncio.Event()
        holder["stop"] = stop
        async with open_engine(cfg, exit_process=crash) as (engine, info):
            holder["engine"], holder["info"] = engine, info
            started.set()
            await stop.wait()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio_asyncio.aio_as_trio(serve))
        with trio.fail_after(30):
            await started.wait()
        try:
            yield InProcessEngine(holder["engine"], holder["info"])
        finally:
            holder["stop"].set()
