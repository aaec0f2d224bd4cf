"""The ``generate`` CLI command (``disagg``: tests/client/test_disagg_flow.py, tests/e2e/test_disagg.py)."""

from __future__ import annotations

import functools
import io
import json
import os
import signal
import subprocess
import sys

import pytest
import trio
from click.testing import CliRunner

from sidecar.cli import main
from sidecar.client.commands import EXIT_INTERRUPTED, run_generate
from sidecar.north.codec import GenerateCommand
from tests.client.fake_sidecar import FakeSidecar


async def run(fake_url: str, prompt: str, **kwargs: object) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    status = await run_generate(fake_url, prompt, out=out, err=err, handle_sigint=False, **kwargs)  # type: ignore[arg-type]
    return status, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("encoding", ["json", "msgpack"])
async def test_streams_text(fake: FakeSidecar, encoding: str) -> None:
    with trio.fail_after(10):
        status, out, err = await run(fake.url, "hello", max_tokens=3, model="m", encoding=encoding)
    assert (status, out, err) == (0, "Hello!\n", "")
    (cmd,) = fake.commands
    assert isinstance(cmd, GenerateCommand)
    assert cmd.request.model == "m" and cmd.request.prompt == "hello"
    assert cmd.request.stopping is not None and cmd.request.stopping.max_tokens == 3


async def test_json_lines(fake: FakeSidecar) -> None:
    with trio.fail_after(10):
        status, out, _ = await run(fake.url, "hello", as_json=True)
    assert status == 0
    lines = [json.loads(line) for line in out.splitlines()]
    assert [line["type"] for line in lines] == ["event"] * 4 + ["end"]
    assert lines[0]["response"]["token"]["text"] == "Hel"
    assert lines[-1]["outcome"] == "completed" and lines[-1]["error"] is None


@pytest.mark.parametrize(
    ("prompt", "needle"),
    [
        ("reject", "rejected: ERROR_CODE_DRAINING: draining (retryable)"),
        ("fail", "failed: ERROR_CODE_INTERNAL"),
    ],
)
async def test_failures_exit_non_zero(fake: FakeSidecar, prompt: str, needle: str) -> None:
    with trio.fail_after(10):
        status, _, err = await run(fake.url, prompt)
    assert status == 1
    assert needle in err


async def test_connection_lost(fake: FakeSidecar) -> None:
    with trio.fail_after(10):
        status, out, err = await run(fake.url, "die")
    assert status == 1
    assert out == "x\n"
    assert err.startswith("openengine-sidecar: connection to sidecar closed (1011")


async def test_connection_refused() -> None:
    with trio.fail_after(10):
        listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
        port = listener.socket.getsockname()[1]
        await listener.aclose()
        status, _, err = await run(f"ws://127.0.0.1:{port}", "hello")
    assert status == 1 and "cannot connect" in err


async def test_ctrl_c_sends_cancel_and_waits_for_end(fake: FakeSidecar) -> None:
    """Real process, real SIGINT: the first Ctrl-C sends cancel, the end arrives, exit 130."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            proc = await nursery.start(
                functools.partial(
                    trio.run_process,
                    [sys.executable, "-m", "sidecar", "generate", "--sidecar", fake.url, "slow"],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    env=env,
                    check=False,
                )
            )
            assert proc.stdout is not None and proc.stderr is not None
            out = b""
            while b"tick" not in out:  # the first token is printed: the stream is open
                chunk = await proc.stdout.receive_some()
                assert chunk, "generate exited before printing a token"
                out += chunk
            proc.send_signal(signal.SIGINT)
            await fake.cancel_seen.wait()
            rest = b""
            while chunk := await proc.stdout.receive_some():
                rest += chunk
            err = b""
            while chunk := await proc.stderr.receive_some():
                err += chunk
            status = await proc.wait()
    assert status == EXIT_INTERRUPTED, err.decode()
    assert len(fake.cancels) == 1
    assert b"cancelling" in err and b"cancelled: ERROR_CODE_CANCELLED" in err
    assert (out + rest).decode() == "tick\n"


def test_help_and_disagg_usage() -> None:
    runner = CliRunner()
    result = runner.invoke(main, ["generate", "--help"])
    assert result.exit_code == 0
    for flag in ("--sidecar", "--max-tokens", "--model", "--json", "OPENENGINE_SIDECAR_GENERATE_SIDECAR"):
        assert flag in result.output
    result = runner.invoke(main, ["disagg"])
    assert result.exit_code == 2 and "Missing argument" in result.output


def test_bad_sidecar_url() -> None:
    result = CliRunner().invoke(main, ["generate", "--sidecar", "http://h:1", "hi"])
    assert result.exit_code == 2 and "ws://" in result.output
