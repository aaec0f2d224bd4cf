"""Run ``python -m sidecar`` as a real process, the way an operator meets the CLI."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import trio

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Done:
    code: int
    out: str
    err: str
    seconds: float

    @property
    def err_lines(self) -> list[str]:
        return [line for line in self.err.splitlines() if line.strip()]


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without any ``OPENENGINE_SIDECAR_*`` variable, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPENENGINE_SIDECAR_")}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


async def cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 30, cwd: Path | None = None
) -> Done:
    """``python -m sidecar ARGS`` to completion; never leaves a traceback unnoticed."""
    started = time.monotonic()
    with trio.fail_after(timeout):
        done = await trio.run_process(
            [sys.executable, "-m", "sidecar", *args],
            stdin=subprocess.DEVNULL,
            capture_stdout=True,
            capture_stderr=True,
            check=False,
            env=env if env is not None else clean_env(),
            cwd=cwd or ROOT,
        )
    result = Done(done.returncode, done.stdout.decode(), done.stderr.decode(), time.monotonic() - started)
    assert "Traceback" not in result.err + result.out, result.err
    return result


def one_line_usage_error(done: Done, flag: str) -> None:
    """Exit 2 with exactly one line on stderr, the CLI's error prefix, naming ``flag``."""
    assert done.code == 2, (done.code, done.err)
    assert len(done.err_lines) == 1, done.err
    assert done.err_lines[0].startswith("openengine-sidecar: "), done.err
    assert flag in done.err_lines[0], done.err
