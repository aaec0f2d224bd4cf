"""Operational failures and signals, as an operator meets them (real processes; issue 21 items
1, 3, 5): one line, the right exit status, promptly, never a traceback; "ready" only once every
listener is bound."""

from __future__ import annotations

import re
import signal
import socket
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
import trio

from sidecar.childproc import ENGINE_READY
from tests.cli.helpers import cli
from tests.e2e.harness import mock_engine, sidecar, spawn

pytestmark = pytest.mark.subprocess

WAITING = re.compile(r"waiting for engine at")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
async def test_signal_during_startup_stops_within_a_second(tmp_path: Path, sig: signal.Signals) -> None:
    with trio.fail_after(30):
        async with spawn(["run", "--engine", f"unix://{tmp_path}/none.sock"]) as proc:
            await proc.wait_for_line(WAITING)
            proc.signal(sig)
            started = time.monotonic()
            code = await proc.wait(timeout=5)
            took = time.monotonic() - started
    assert code == 0 and took < 1.0, (code, took)
    assert f"{sig.name} while starting: stopping" in proc.lines[-1], proc.lines
    assert not any("Traceback" in line for line in proc.lines)


def _held_port() -> socket.socket:
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    return held


LISTENERS = {
    "--listen": "127.0.0.1:{port}",
    "--http-listen": "127.0.0.1:{port}",
    "--kv-publish": "tcp://127.0.0.1:{port}",
    "--kv-replay": "tcp://127.0.0.1:{port}",
}


@pytest.mark.parametrize("flag", list(LISTENERS))
async def test_port_in_use_is_one_line_and_never_ready(aio_loop: Any, tmp_path: Path, flag: str) -> None:
    """Every listener of ``run``; "ready" is logged only once all of them are bound."""
    with _held_port() as held, trio.fail_after(60):
        port = held.getsockname()[1]
        async with mock_engine(tmp_path) as engine:
            listeners = {f: a.format(port=0) for f, a in LISTENERS.items()}
            listeners[flag] = LISTENERS[flag].format(port=port)
            done = await cli("run", "--engine", engine.address, *(x for kv in listeners.items() for x in kv))
    assert done.code == 1, done.err
    assert done.err_lines[-1] == (
        f"openengine-sidecar: cannot listen on {flag} {LISTENERS[flag].format(port=port)} (Address already in "
        "use) (in use by another process: a second sidecar on one host needs its own ports, or port 0 for "
        "any free one)"
    ), done.err
    assert "ready: serving" not in done.err, done.err


async def test_every_clash_is_named_at_once(aio_loop: Any, tmp_path: Path) -> None:
    """A second sidecar on one host: every listen address taken, one line naming each with its
    flag (it met them one failure at a time, the first one naming no flag)."""
    with ExitStack() as stack, trio.fail_after(60):
        ports = [stack.enter_context(_held_port()).getsockname()[1] for _ in LISTENERS]
        listeners = {
            flag: address.format(port=p) for (flag, address), p in zip(LISTENERS.items(), ports, strict=True)
        }
        async with mock_engine(tmp_path) as engine:
            done = await cli("run", "--engine", engine.address, *(x for kv in listeners.items() for x in kv))
    assert done.code == 1, done.err
    last = done.err_lines[-1]
    assert last.startswith("openengine-sidecar: cannot listen on "), done.err
    for flag, address in listeners.items():
        assert f"{flag} {address} (Address already in use)" in last, done.err
    assert "ready: serving" not in done.err and "Traceback" not in done.err, done.err


async def test_mock_engine_refuses_a_socket_path_another_engine_serves(aio_loop: Any, tmp_path: Path) -> None:
    with trio.fail_after(60):
        async with mock_engine(tmp_path) as first:
            done = await cli("mock-engine", "--listen", first.address)
            assert done.code == 1, done.err
            assert done.err_lines == [
                f"openengine-sidecar: cannot serve on {first.address}: "
                f"another live process serves {first.address[len('unix://') :]}"
            ]
            # the first engine still serves its path
            from sidecar.openengine.client import open_engine_client

            async with open_engine_client(first.address) as client:
                assert (await client.health()).state is not None


async def test_mock_engine_takes_over_a_stale_socket(tmp_path: Path) -> None:
    path = tmp_path / "stale.sock"
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(path))
    stale.close()  # the file stays; nothing accepts on it
    with trio.fail_after(30):
        async with spawn(["mock-engine", "--listen", f"unix://{path}"]) as proc:
            await proc.wait_for_line(ENGINE_READY)


async def test_readme_conformance_step_passes_on_the_readme_engine(tmp_path: Path) -> None:
    """README: ``mock-engine ... --listen unix:///tmp/engine.sock`` then ``conformance --engine``."""
    sock = tmp_path / "engine.sock"
    with trio.fail_after(240):
        async with spawn(
            ["mock-engine", "--flavor", "vllm", "--role", "aggregated", "--listen", f"unix://{sock}"]
        ) as eng:
            await eng.wait_for_line(ENGINE_READY)
            done = await cli("conformance", "--engine", f"unix://{sock}", timeout=200)
    assert done.code == 0, done.out[-3000:] + done.err


async def test_conformance_report_directory_is_checked_before_the_suite(
    aio_loop: Any, tmp_path: Path
) -> None:
    """It was checked only when writing the report, after the whole suite had run."""
    with trio.fail_after(120):
        async with mock_engine(tmp_path) as engine:
            report = tmp_path / "missing" / "r.json"
            done = await cli("conformance", "--engine", engine.address, "--json", str(report))
    assert done.code == 2 and "--json" in done.err_lines[-1], done.err
    assert "pass" not in done.out, done.out  # no check ran


async def test_client_errors_name_the_cause_and_the_address(tmp_path: Path) -> None:
    held = _held_port()
    port = held.getsockname()[1]
    held.close()  # now nothing listens there
    done = await cli("generate", "--sidecar", f"ws://127.0.0.1:{port}", "hi")
    assert done.code == 1
    assert done.err_lines == [
        f"openengine-sidecar: cannot connect to ws://127.0.0.1:{port}/v1/ws: connection refused "
        "(nothing listens there: is the sidecar running?)"
    ], done.err
    done = await cli(
        "disagg", "--prefill", f"ws://127.0.0.1:{port}", "--decode", f"ws://127.0.0.1:{port + 1}", "hi"
    )
    assert done.code == 1
    assert f"decode ws://127.0.0.1:{port + 1}/v1/ws: unreachable" in done.err, done.err
    assert f"prefill ws://127.0.0.1:{port}/v1/ws: unreachable" in done.err, done.err


async def test_generate_at_the_http_port_is_told_so(aio_loop: Any, tmp_path: Path) -> None:
    """It said "HTTP 403", which read like an authorization problem."""
    with trio.fail_after(60):
        async with mock_engine(tmp_path) as engine, sidecar(engine.address, "--no-kv-events") as sc:
            port = sc.http.rsplit(":", 1)[1]
            done = await cli("generate", "--sidecar", f"ws://127.0.0.1:{port}", "hi")
    assert done.code == 1
    assert done.err_lines == [
        f"openengine-sidecar: cannot connect to ws://127.0.0.1:{port}/v1/ws: that is the sidecar's HTTP "
        "port (probes, metrics), not its WebSocket port: connect to its --listen address (default port 8600)"
    ], done.err


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--kv-host", "192.0.2.1"], "--kv-host 192.0.2.1 --kv-port 0: cannot bind the KV event publisher"),
        (
            ["--role", "prefill", "--transfer-host", "192.0.2.1"],
            "--transfer-host 192.0.2.1 --transfer-port 0: cannot listen for KV transfers",
        ),
    ],
    ids=["kv-host", "transfer-host"],
)
async def test_mock_engine_bind_failures_name_the_flag(tmp_path: Path, args: list[str], needle: str) -> None:
    """192.0.2.1 (TEST-NET-1) is no local address: the bind fails. It was a 58-line traceback
    (the KV publisher) or blamed on --listen (the transfer listener)."""
    done = await cli("mock-engine", "--listen", f"unix://{tmp_path}/e.sock", *args)
    assert done.code == 1, done.err
    assert len(done.err_lines) == 1 and needle in done.err_lines[0], done.err
    assert "ready" not in done.err, done.err
