"""A ``wss://`` client against a plain WebSocket port: the TLS mismatch named at once (issue 21
item 8), not a connect timeout after ten seconds."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest
import trio

from sidecar.client import SidecarConnectionError, open_sidecar
from tests.cli.helpers import cli
from tests.e2e.harness import mock_engine, sidecar

pytestmark = pytest.mark.subprocess


async def test_wss_against_a_plain_port_says_tls(aio_loop: Any, tmp_path: Path) -> None:
    with trio.fail_after(60):
        async with mock_engine(tmp_path) as engine, sidecar(engine.address, "--no-kv-events") as sc:
            url = sc.ws.replace("ws://", "wss://")
            done = await cli("generate", "--sidecar", url, "hi")
            # The time to say so, measured in-process: the CLI's own wall time is mostly the
            # interpreter's start, seconds on a loaded machine (8.5 s seen in CI).
            start = trio.current_time()
            with pytest.raises(SidecarConnectionError, match="TLS handshake failed"):
                async with open_sidecar(url, connect_timeout=10):
                    pass
            elapsed = trio.current_time() - start
    assert done.code == 1
    assert len(done.err_lines) == 1 and done.err_lines[0].startswith(
        f"openengine-sidecar: cannot connect to {url}: TLS"
    ), done.err
    assert elapsed < 2, elapsed  # not the 10 s connect timeout


async def test_missing_token_says_401_and_the_address(aio_loop: Any, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    with trio.fail_after(60):
        async with (
            mock_engine(tmp_path) as engine,
            sidecar(engine.address, "--no-kv-events", "--auth-token-file", str(token)) as sc,
        ):
            done = await cli("generate", "--sidecar", sc.ws, "hi")
    assert done.code == 1
    assert done.err_lines == [
        f"openengine-sidecar: cannot connect to {sc.ws}: 401 unauthorized: the sidecar wants a bearer token "
        "(--auth-token-file); none or a wrong one was sent"
    ], done.err


async def test_a_silent_port_is_a_named_timeout(tmp_path: Path) -> None:
    """A listener that never answers the WebSocket handshake: the bound and the address named."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()  # the kernel completes TCP handshakes; nothing ever answers
        port = silent.getsockname()[1]
        done = await cli(
            "disagg",
            "--prefill",
            f"ws://127.0.0.1:{port}",
            "--decode",
            f"ws://127.0.0.1:{port}",
            "--connect-timeout",
            "1",
            "hi",
        )
    assert done.code == 1, done.err
    assert f"ws://127.0.0.1:{port}/v1/ws" in done.err and "within 1s" in done.err, done.err
    assert done.seconds < 10, done.seconds
