"""``openengine-sidecar conformance`` as a user runs it: a subprocess against a mock-engine subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import trio

from sidecar.conformance.runner import all_checks
from tests.mock_engines import run_mock_engine


async def _cli(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[bytes]:
    with trio.fail_after(timeout):
        return await trio.run_process(
            [sys.executable, "-m", "sidecar", "conformance", *args],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )


async def test_list_usage_and_unreachable() -> None:
    listed = await _cli("--list")
    assert listed.returncode == 0
    out = listed.stdout.decode()
    assert all(c.id in out for c in all_checks())
    missing = await _cli()
    assert missing.returncode == 2 and b"--engine" in missing.stderr
    half = await _cli("--prefill", "127.0.0.1:1")
    assert half.returncode == 2 and b"go together" in half.stderr
    gone = await _cli("--engine", "127.0.0.1:1", "--connect-timeout", "2")
    assert gone.returncode == 2 and b"openengine-sidecar: --engine 127.0.0.1:1" in gone.stderr
    typo = await _cli("--engine", "127.0.0.1:1", "--only", "genrate")
    assert typo.returncode == 2 and b"matches no check" in typo.stderr


async def test_run_reports_and_exit_status(tmp_path: Path) -> None:
    async with run_mock_engine(tmp_path, "vllm", faults=["wrong-release"], orphans="release") as engine:
        report_path = tmp_path / "report.json"
        failing = await _cli("--engine", engine.address, "--only", "discovery", "--json", str(report_path))
        passing = await _cli("--engine", engine.address, "--only", "generate.one-finish", "--json", "-")
    text = failing.stdout.decode()
    assert failing.returncode == 1, failing.stderr.decode()
    assert "FAIL  discovery.release" in text  # a progress line (stdout is not a TTY: plain lines)
    assert "RESULT  CHECK" in text and "FAILED:" in text
    data: dict[str, Any] = json.loads(report_path.read_text())
    assert data["summary"]["fail"] == 1 and not data["summary"]["ok"]
    failed = [c for c in data["checks"] if c["status"] == "fail"]
    assert [c["id"] for c in failed] == ["discovery.release"]
    assert "'main'" in failed[0]["reason"]
    assert data["engines"]["engine"]["engine_name"] == "vllm"
    assert passing.returncode == 0, passing.stderr.decode()
    data = json.loads(passing.stdout)  # --json -: the JSON alone on stdout, the table on stderr
    assert [c["id"] for c in data["checks"]] == ["generate.one-finish"] and data["summary"]["ok"]
    assert b"OK: 1 check against" in passing.stderr
