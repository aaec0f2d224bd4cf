"""Dynamo's production planes as real processes for the tests: ``etcd`` (discovery and leases)
and ``nats-server`` (the NATS request and event planes), on loopback.

Each server gets free ports and a fresh data directory under the test's tmp dir, is ready
when it logs so (never a sleep), and is stopped (SIGTERM, then SIGKILL) when its context
ends. :meth:`PlaneServer.restart` stops it and starts it again on the same ports, keeping or
wiping its data: an etcd that comes back *empty* has lost every lease and registration (a
failover to a fresh member), one restarted on its data has not.

:class:`Deployment` is one test deployment's settings — discovery backend, request plane,
event plane — and the environment the frontend, the workers and the test process share.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from sidecar.childproc import ChildProcess, spawn_child
from tests.prereq import require_tool

ETCD_READY = re.compile(r"ready to serve client requests")
NATS_READY = re.compile(r"Server is ready")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PlaneServer:
    """One plane server process (see the module doc); started in the nursery given."""

    def __init__(
        self,
        nursery: trio.Nursery,
        name: str,
        argv: Callable[[], list[str]],
        ready: re.Pattern[str],
        data_dir: Path,
    ) -> None:
        self.name = name
        self.data_dir = data_dir
        self.proc: ChildProcess | None = None
        self.restarts = 0
        self._nursery = nursery
        self._argv = argv
        self._ready = ready
        self._stop = trio.Event()
        self._stopped = trio.Event()
        self._stopped.set()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.process.returncode is None

    async def start(self, timeout: float = 30) -> None:
        if not self._stopped.is_set():
            raise RuntimeError(f"{self.name} is running")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._stop, self._stopped = trio.Event(), trio.Event()
        with trio.fail_after(timeout):
            self.proc = await self._nursery.start(self._run)

    async def _run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        try:
            async with spawn_child(self._argv(), name=self.name, keep_lines=500, term_timeout=5) as proc:
                await proc.wait_for_line(self._ready, timeout=30)
                task_status.started(proc)
                await self._stop.wait()
        finally:
            self._stopped.set()

    async def stop(self) -> None:
        """Stop the server (SIGTERM, SIGKILL after 5 s) and wait until it is gone."""
        self._stop.set()
        with trio.fail_after(15):
            await self._stopped.wait()

    async def restart(self, *, keep_data: bool = True, down_for: float = 0.0) -> None:
        """Stop, stay down ``down_for`` seconds, start again on the same ports; without
        ``keep_data`` the data directory is wiped first (the server comes back empty)."""
        await self.stop()
        if not keep_data:
            shutil.rmtree(self.data_dir, ignore_errors=True)
        if down_for:
            await trio.sleep(down_for)  # the outage itself is what the test injects
        await self.start()
        self.restarts += 1


@dataclass
class Etcd:
    server: PlaneServer
    url: str


@dataclass
class Nats:
    server: PlaneServer
    url: str


@asynccontextmanager
async def etcd_server(
    tmp_path: Path, name: str = "etcd", *, wrap: Callable[[list[str]], list[str]] | None = None
) -> AsyncIterator[Etcd]:
    """``etcd`` (Debian's ``etcd-server``) on two free loopback ports, data under ``tmp_path``;
    ``wrap`` rewrites its command line (e.g. to run it in a network namespace)."""
    etcd = require_tool("etcd")
    client, peer = free_port(), free_port()
    url, peer_url = f"http://127.0.0.1:{client}", f"http://127.0.0.1:{peer}"
    data = tmp_path / f"{name}-data"

    def argv() -> list[str]:
        return (wrap or list)(
            [
                etcd,
                "--name",
                "default",
                "--data-dir",
                str(data),
                "--listen-client-urls",
                url,
                "--advertise-client-urls",
                url,
                "--listen-peer-urls",
                peer_url,
                "--initial-advertise-peer-urls",
                peer_url,
                "--initial-cluster",
                f"default={peer_url}",
            ]
        )

    async with trio.open_nursery() as nursery:
        server = PlaneServer(nursery, name, argv, ETCD_READY, data)
        await server.start()
        try:
            yield Etcd(server, url)
        finally:
            await server.stop()


@asynccontextmanager
async def nats_server(tmp_path: Path, name: str = "nats") -> AsyncIterator[Nats]:
    """``nats-server`` with JetStream on a free loopback port, storage under ``tmp_path``."""
    nats = require_tool("nats-server")
    port = free_port()
    data = tmp_path / f"{name}-data"

    def argv() -> list[str]:
        return [nats, "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", str(data)]

    async with trio.open_nursery() as nursery:
        server = PlaneServer(nursery, name, argv, NATS_READY, data)
        await server.start()
        try:
            yield Nats(server, f"nats://127.0.0.1:{port}")
        finally:
            await server.stop()


#: Request plane x event plane combinations Dynamo 1.6 offers (discovery: etcd for all).
PLANE_COMBINATIONS = [("tcp", "zmq"), ("tcp", "nats"), ("nats", "zmq"), ("nats", "nats")]


@dataclass
class Deployment:
    """One test deployment: where discovery lives and which planes carry requests and events."""

    tmp_path: Path
    discovery: str = "etcd"
    request_plane: str = "tcp"
    event_plane: str = "zmq"
    etcd: Etcd | None = None
    nats: Nats | None = None
    extra_env: dict[str, str] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"{self.discovery}/{self.request_plane}/{self.event_plane}"

    def env(self) -> dict[str, str]:
        """DYN_* settings shared by the frontend, the workers and an observer in the test."""
        env = {
            "DYN_DISCOVERY_BACKEND": self.discovery,
            "DYN_REQUEST_PLANE": self.request_plane,
            "DYN_EVENT_PLANE": self.event_plane,
            "DYN_TCP_RPC_HOST": "127.0.0.1",
            "DYN_TCP_RESPONSE_STREAM_HOST": "127.0.0.1",
            "DYN_EVENT_PLANE_HOST": "127.0.0.1",
            "DYN_SELF_HOST_METADATA": "0",
            "DYN_LOG": os.environ.get("DYN_LOG", "warn"),
        }
        if self.discovery == "file":
            env["DYN_FILE_KV"] = str(self.tmp_path / "dynamo-kv")
        if self.etcd is not None:
            env["ETCD_ENDPOINTS"] = self.etcd.url
        if self.nats is not None:
            env["NATS_SERVER"] = self.nats.url
        return {**env, **self.extra_env}

    def frontend_args(self) -> list[str]:
        return [
            "--discovery-backend",
            self.discovery,
            "--request-plane",
            self.request_plane,
            "--event-plane",
            self.event_plane,
        ]

    def sidecar_args(self) -> list[str]:
        return [
            "--dynamo-discovery-backend",
            self.discovery,
            "--dynamo-request-plane",
            self.request_plane,
            "--dynamo-event-plane",
            self.event_plane,
        ]


@asynccontextmanager
async def deployment(
    tmp_path: Path, request_plane: str = "tcp", event_plane: str = "zmq", *, nats: bool | None = None
) -> AsyncIterator[Deployment]:
    """etcd discovery (a fresh etcd) and the planes asked for; NATS is started when a plane
    needs it (or ``nats=True``)."""
    want_nats = nats if nats is not None else "nats" in (request_plane, event_plane)
    async with etcd_server(tmp_path) as etcd:
        if not want_nats:
            yield Deployment(tmp_path, "etcd", request_plane, event_plane, etcd=etcd)
            return
        async with nats_server(tmp_path) as nats_:
            yield Deployment(tmp_path, "etcd", request_plane, event_plane, etcd=etcd, nats=nats_)


def file_deployment(tmp_path: Path) -> Deployment:
    """File discovery under ``tmp_path``, tcp requests, zmq events: no server at all."""
    return Deployment(tmp_path, "file", "tcp", "zmq")
