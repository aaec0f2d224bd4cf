"""A ``wss://`` client against a plain WebSocket port: the TLS mismatch named at once (issue 21
item 8), not a connect timeout after ten seconds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from tests.cli.helpers import cli
from tests.e2e.harness import mock_engine, sidecar

pytestmark = pytest.mark.slow


async def test_wss_against_a_plain_port_says_tls(aio_loop: Any, tmp_path: Path) -> None:
    with trio.fail_after(60):
        async with mock_engine(tmp_path) as engine, sidecar(engine.address, "--no-kv-events") as sc:
            url = sc.ws.replace("ws://", "wss://")
            done = await cli("generate", "--sidecar", url, "hi")
    assert done.code == 1
    assert len(done.err_lines) == 1 and done.err_lines[0].startswith(
        f"error: cannot connect to {url}: TLS"
    ), done.err
    assert done.seconds < 5, done.seconds
