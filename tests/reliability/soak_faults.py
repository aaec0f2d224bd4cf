"""The soak's deployment with faults on a schedule (``scripts/soak --faults``).

The engine runs in its own network namespace on TCP (``10.231.0.1``), the sidecar in another
(tests/netns.py); the soak process enters the sidecar's namespace for its clients. Faults,
one at a time, injected a moment into a round and over before the round settles:

- ``hang``: the engine frozen (SIGSTOP) for :data:`HANG_SECONDS`, then SIGCONT;
- ``kill``: the engine killed (SIGKILL) and started again on the same address;
- ``partition``: the engine's traffic black-holed (iptables DROP) for :data:`PARTITION_SECONDS`;
- ``etcd`` (with ``--dynamo``): etcd restarted on its data (the Dynamo plane must stay
  registered).

Processes: the engine is a :class:`tests.dynamo.planes.PlaneServer` (so it can be killed and
started again); the sidecar and etcd live for the whole soak. Everything stops when the
context ends; the namespaces are removed.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from sidecar.childproc import ENGINE_READY, SIDECAR_READY, ChildProcess, loopback_run_args
from tests.dynamo.planes import Etcd, PlaneServer, etcd_server
from tests.e2e.harness import spawn_argv
from tests.netns import NetnsPair, netns_pair

HANG_SECONDS = 10.0
PARTITION_SECONDS = 10.0
KILL_DOWN_SECONDS = 2.0
ENGINE_PORT = 50051
FAULTS = ("hang", "kill", "partition")


def open_fds(pid: int) -> int:
    """Open file descriptors of ``pid``."""
    return len(os.listdir(f"/proc/{pid}/fd"))


@dataclass
class FaultyDeployment:
    net: NetnsPair
    engine: PlaneServer
    engine_address: str
    sidecar: ChildProcess
    ws: str
    http: str
    etcd: Etcd | None

    @property
    def faults(self) -> tuple[str, ...]:
        return (*FAULTS, "etcd") if self.etcd is not None else FAULTS

    @property
    def engine_pid(self) -> int:
        assert self.engine.proc is not None
        return self.engine.proc.pid

    async def inject(self, fault: str, delay: float = 0.5) -> None:
        """``fault`` (module doc), ``delay`` seconds from now; returns once it is over."""
        await trio.sleep(delay)  # a moment into the round: streams are in flight
        if fault == "hang":
            assert self.engine.proc is not None
            self.engine.proc.signal(signal.SIGSTOP)
            try:
                await trio.sleep(HANG_SECONDS)
            finally:
                self.engine.proc.signal(signal.SIGCONT)
        elif fault == "kill":
            assert self.engine.proc is not None
            self.engine.proc.process.kill()
            await self.engine.restart(down_for=KILL_DOWN_SECONDS)
        elif fault == "partition":
            self.net.partition()
            try:
                await trio.sleep(PARTITION_SECONDS)
            finally:
                self.net.heal()
        elif fault == "etcd":
            assert self.etcd is not None
            await self.etcd.server.restart(keep_data=True, down_for=2.0)
        else:
            raise ValueError(f"unknown fault {fault!r}")


@asynccontextmanager
async def faulty_deployment(
    tmp: Path, engine_args: list[str], sidecar_args: list[str], *, dynamo: bool = False
) -> AsyncIterator[FaultyDeployment]:
    """Namespaces, the engine, (etcd,) the sidecar — see the module doc."""
    with netns_pair() as net:
        address = f"{net.engine_ip}:{ENGINE_PORT}"
        async with AsyncExitStack() as stack:
            nursery = await stack.enter_async_context(trio.open_nursery())
            extra_engine: list[str] = []
            extra_sidecar: list[str] = []
            env: dict[str, str] = {}
            etcd = None
            if dynamo:
                from sidecar.dynamo.tokenizer_dir import write_mock_tokenizer_dir

                tok = write_mock_tokenizer_dir(tmp / "mock-tokenizer")
                extra_engine = ["--tokenizer-source", str(tok)]
                etcd = await stack.enter_async_context(
                    etcd_server(tmp, wrap=lambda a: net.argv(net.sidecar, a))
                )
                env = {
                    "ETCD_ENDPOINTS": etcd.url,
                    "DYN_TCP_RPC_HOST": "127.0.0.1",
                    "DYN_TCP_RESPONSE_STREAM_HOST": "127.0.0.1",
                    "DYN_EVENT_PLANE_HOST": "127.0.0.1",
                    "DYN_LOG": "warn",
                }
                extra_sidecar = ["--dynamo", "--dynamo-discovery-backend", "etcd"]
            argv = [
                sys.executable,
                "-m",
                "sidecar",
                "mock-engine",
                "--listen",
                address,
                "--kv-host",
                net.engine_ip,
                *engine_args,
                *extra_engine,
            ]
            engine = PlaneServer(
                nursery, "mock-engine", lambda: net.argv(net.engine, argv), ENGINE_READY, tmp
            )
            await engine.start()
            stack.push_async_callback(engine.stop)
            sc_argv = [
                sys.executable,
                "-m",
                "sidecar",
                *loopback_run_args(address),
                *sidecar_args,
                *extra_sidecar,
            ]
            sc = await stack.enter_async_context(
                spawn_argv(net.argv(net.sidecar, sc_argv), env, label="sidecar")
            )
            m = await sc.wait_for_line(SIDECAR_READY, timeout=120)
            try:
                yield FaultyDeployment(net, engine, address, sc, m.group(1), m.group(2), etcd)
            finally:
                net.heal()


def fault_schedule(faults: tuple[str, ...]) -> Any:
    """The faults in turn, for ever."""
    while True:
        yield from faults
