"""Launch scripts: bash -n and shellcheck on every script; the local-mock scripts end to end."""

from __future__ import annotations

import os
import re
import signal
import subprocess
from functools import partial
from pathlib import Path

import pytest
import trio

from tests.deploy.helpers import LAUNCH, ROOT
from tests.prereq import require_tool

SCRIPTS = sorted(
    [*LAUNCH.glob("*.sh"), *(ROOT / "scripts").glob("*")],
    key=str,
)
SHELL_SCRIPTS = [
    p
    for p in SCRIPTS
    if p.is_file() and p.read_text().startswith(("#!/usr/bin/env bash", "# shellcheck shell=bash"))
]
OURS = [
    LAUNCH / "lib.sh",
    *sorted(LAUNCH.glob("*.sh")),
    ROOT / "scripts" / "build-artifact",
    ROOT / "scripts" / "lock",
]
OURS += [ROOT / "scripts" / "setup", ROOT / "scripts" / "ci-deps"]


def test_every_launch_script_is_covered() -> None:
    names = {p.name for p in LAUNCH.glob("*.sh")}
    for engine in ("vllm", "sglang", "trtllm"):
        assert {f"{engine}-agg.sh", f"{engine}-disagg.sh"} <= names
    assert {"local-mock-agg.sh", "local-mock-disagg.sh", "lib.sh"} <= names
    for script in LAUNCH.glob("*.sh"):
        if script.name != "lib.sh":
            assert os.access(script, os.X_OK), f"{script.name} is not executable"


@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_bash_n(script: Path) -> None:
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr


def test_shellcheck() -> None:
    tool = require_tool("shellcheck")
    result = subprocess.run(
        [tool, "-x", *map(str, SHELL_SCRIPTS)], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert set(OURS) <= set(SHELL_SCRIPTS)


async def run_script(script: str, tmp_path: Path, env: dict[str, str], timeout: float = 90) -> str:
    """Run a launch script with --check in its own process group; return its stdout."""
    full_env = {**os.environ, "RUN_DIR": str(tmp_path / "run"), **env}
    with trio.fail_after(timeout):
        result = await trio.run_process(
            [str(LAUNCH / script), "--check"],
            env=full_env,
            capture_stdout=True,
            capture_stderr=True,
            check=False,
            start_new_session=True,
        )
    out = result.stdout.decode()
    assert result.returncode == 0, out + result.stderr.decode() + logs(tmp_path / "run")
    return out


def logs(run_dir: Path) -> str:
    return "".join(f"\n--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(run_dir.glob("*.log")))


def ephemeral(prefix: str = "") -> dict[str, str]:
    return {
        f"{prefix}LISTEN": "127.0.0.1:0",
        f"{prefix}HTTP_LISTEN": "127.0.0.1:0",
        f"{prefix}KV_PUBLISH": "tcp://127.0.0.1:0",
        f"{prefix}KV_REPLAY": "tcp://127.0.0.1:0",
    }


@pytest.mark.subprocess
@pytest.mark.parametrize("flavor", ["vllm", "sglang"])
async def test_local_mock_agg(tmp_path: Path, flavor: str) -> None:
    out = await run_script("local-mock-agg.sh", tmp_path, {"FLAVOR": flavor, **ephemeral()})
    assert re.search(rf"sidecar ready: ws://127\.0\.0\.1:\d+/v1/ws .*simulated {flavor} engine", out)
    command = re.search(r"a request:\n  (.*)\n", out)
    assert command and " generate --sidecar ws://127.0.0.1:" in command.group(1)
    assert "--- running the request:" in out and "--- request completed" in out
    text = out.split("--- running the request:\n", 1)[1].split("\n--- request completed", 1)[0]
    assert len(text.split()) >= 8, f"no completion text: {text!r}"
    # Everything it started is gone: nothing left in the process group, no socket answering.
    assert not list((tmp_path / "run").glob("*.sock")) or not any(
        p.is_socket() and _listening(p) for p in (tmp_path / "run").glob("*.sock")
    )


def _listening(path: Path) -> bool:
    import socket

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(str(path))
        except OSError:
            return False
        return True


@pytest.mark.subprocess
@pytest.mark.parametrize("flavor", ["vllm", "sglang"])  # context-first and client bootstrap
async def test_local_mock_disagg(tmp_path: Path, flavor: str) -> None:
    env = {"FLAVOR": flavor, **ephemeral("PREFILL_"), **ephemeral("DECODE_")}
    out = await run_script("local-mock-disagg.sh", tmp_path, env)
    prefill = re.search(r"prefill sidecar ready: (ws://\S+)", out)
    decode = re.search(r"decode sidecar ready:  (ws://\S+)", out)
    assert prefill and decode and prefill.group(1) != decode.group(1)
    command = re.search(r"a prefill/decode request:\n  (.*)\n", out)
    assert command
    assert f"disagg --prefill {prefill.group(1)} --decode {decode.group(1)}" in command.group(1)
    if "--- request completed" in out:  # `openengine-sidecar disagg` is available in this build
        text = out.split("--- running the request:\n", 1)[1].split("\n--- request completed", 1)[0]
        assert len(text.split()) >= 8, f"no completion text: {text!r}"
    else:
        assert f"prefill sidecar serves a prefill engine: {flavor}" in out
        assert f"decode sidecar serves a decode engine: {flavor}" in out


@pytest.mark.subprocess
async def test_local_mock_stops_everything_on_sigterm(tmp_path: Path) -> None:
    """Without --check the script serves until signalled, then stops what it started."""
    env = {**os.environ, "RUN_DIR": str(tmp_path / "run"), **ephemeral()}
    with trio.fail_after(90):
        async with trio.open_nursery() as nursery:
            proc = await nursery.start(
                partial(
                    trio.run_process,
                    [str(LAUNCH / "local-mock-agg.sh")],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,
                    check=False,
                    start_new_session=True,
                )
            )
            assert proc.stdout is not None
            seen = b""
            async for chunk in proc.stdout:
                seen += chunk
                if b"--- request completed" in seen:
                    break
            proc.send_signal(signal.SIGTERM)
            await proc.wait()
    assert proc.returncode == 143
    # Nothing of the process group survived.
    with pytest.raises(ProcessLookupError):
        os.killpg(proc.pid, 0)
