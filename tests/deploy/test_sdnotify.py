"""sd_notify: the datagram protocol, then the real `run` process against a real NOTIFY_SOCKET."""

from __future__ import annotations

import os
import signal
import socket
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from sidecar import sdnotify
from tests.deploy.helpers import DEPLOY
from tests.e2e.harness import SIDECAR_READY, mock_engine, spawn


def datagram_socket(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(5)
    return sock


def test_notify_sends_one_datagram(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with datagram_socket(tmp_path / "n.sock") as sock:
        monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "n.sock"))
        assert sdnotify.notify("READY=1", "STATUS=serving") is True
        assert sock.recv(4096) == b"READY=1\nSTATUS=serving"


def test_notify_abstract_namespace(monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"openengine-sidecar-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(5)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert sdnotify.notify("STOPPING=1") is True
        assert sock.recv(4096) == b"STOPPING=1"


def test_notify_without_socket_is_a_no_op(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert sdnotify.notify("READY=1") is False
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "absent.sock"))
    assert sdnotify.notify("READY=1") is False  # never raises
    with datagram_socket(tmp_path / "n.sock"):
        monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "n.sock"))
        assert sdnotify.notify() is False


@pytest.mark.parametrize(
    ("usec", "pid", "expected"),
    [
        (None, None, None),
        ("30000000", None, 15.0),
        ("30000000", "self", 15.0),
        ("30000000", "1", None),  # the watchdog targets another process
        ("junk", None, None),
    ],
)
def test_watchdog_interval(
    monkeypatch: pytest.MonkeyPatch, usec: str | None, pid: str | None, expected: Any
) -> None:
    for var, value in (("WATCHDOG_USEC", usec), ("WATCHDOG_PID", str(os.getpid()) if pid == "self" else pid)):
        if value is None:
            monkeypatch.delenv(var, raising=False)
        else:
            monkeypatch.setenv(var, value)
    assert sdnotify.watchdog_interval() == expected


class Notifications:
    """Every datagram the sidecar sends to our NOTIFY_SOCKET, in order."""

    def __init__(self, sock: trio.socket.SocketType) -> None:
        self.sock = sock
        self.messages: list[list[str]] = []

    async def until(self, state: str) -> list[str]:
        """Receive until a message containing ``state`` arrives; return that message."""
        while True:
            data = await self.sock.recv(4096)
            message = data.decode().split("\n")
            self.messages.append(message)
            if state in message:
                return message

    def index(self, state: str) -> int:
        return next(i for i, m in enumerate(self.messages) if state in m)


async def test_run_notifies_ready_watchdog_and_stopping(aio_loop: Any, tmp_path: Path) -> None:
    """READY=1 once serving (with /ready 200), WATCHDOG=1 while running, STOPPING=1 on SIGTERM, exit 0."""
    with trio.fail_after(60):
        sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        await sock.bind(str(tmp_path / "notify.sock"))
        notes = Notifications(sock)
        env = {"NOTIFY_SOCKET": str(tmp_path / "notify.sock"), "WATCHDOG_USEC": "200000"}
        async with mock_engine(tmp_path, "--flavor", "sglang") as engine:
            args = [
                "run",
                "--engine",
                engine.address,
                "--listen",
                "127.0.0.1:0",
                "--http-listen",
                "127.0.0.1:0",
            ]
            args += ["--kv-publish", "tcp://127.0.0.1:0", "--kv-replay", "tcp://127.0.0.1:0"]
            async with spawn(args, env=env) as proc:
                ready = await notes.until("READY=1")
                assert any(s.startswith("STATUS=serving sglang aggregated on ws://") for s in ready)
                http = (await proc.wait_for_line(SIDECAR_READY)).group(2)
                async with httpx.AsyncClient() as client:
                    assert (await client.get(http + "/ready", timeout=5)).status_code == 200
                # The container's HEALTHCHECK command against the live process.
                health_env = {"OPENENGINE_SIDECAR_HTTP_LISTEN": http.removeprefix("http://")}
                checked = await trio.run_process(
                    [sys.executable, str(DEPLOY / "container" / "healthcheck.py")],
                    env=health_env,
                    check=False,
                )
                assert checked.returncode == 0
                await notes.until("WATCHDOG=1")
                proc.signal(signal.SIGTERM)
                stopping = await notes.until("STOPPING=1")
                assert "STATUS=draining" in stopping
                assert await proc.wait() == 0
        sock.close()
    assert notes.index("READY=1") < notes.index("WATCHDOG=1") < notes.index("STOPPING=1")
    assert sum("READY=1" in m for m in notes.messages) == 1


async def test_run_without_notify_socket_serves(aio_loop: Any, tmp_path: Path) -> None:
    """Outside systemd (no NOTIFY_SOCKET) nothing is sent and nothing breaks."""
    with trio.fail_after(60):
        async with mock_engine(tmp_path, "--flavor", "vllm") as engine:
            args = [
                "run",
                "--engine",
                engine.address,
                "--listen",
                "127.0.0.1:0",
                "--http-listen",
                "127.0.0.1:0",
            ]
            args += ["--no-kv-events"]
            async with spawn(args, env={"NOTIFY_SOCKET": ""}) as proc:
                await proc.wait_for_line(SIDECAR_READY)
                proc.signal(signal.SIGTERM)
                assert await proc.wait() == 0
