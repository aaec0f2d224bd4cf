"""``scripts/demo`` — the README's first command — as a user runs it (issue 21 item 9): a real
process, its output, exit status and timing. The engine's and the sidecar's log lines are shown
between the steps, never inside the streamed text; Ctrl-C stops it with one line, no traceback,
and leaves no child behind."""

from __future__ import annotations

import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import trio

from tests.cli.helpers import ROOT, clean_env

pytestmark = pytest.mark.subprocess

DEMO = ROOT / "scripts" / "demo"
STREAMED = "== a streamed completion"
LOG_LINE = re.compile(r"\[(engine |sidecar)\]|\d\d:\d\d:\d\d|INFO|WARNING")


class Run:
    """The demo's stdout and stderr as they arrive."""

    def __init__(self) -> None:
        self.out = b""
        self.err = b""
        self.changed = trio.Event()

    async def pump(self, stream: trio.abc.ReceiveStream, which: str) -> None:
        async for chunk in stream:
            setattr(self, which, getattr(self, which) + chunk)
            self.changed.set()
            self.changed = trio.Event()

    async def until(self, text: str) -> None:
        while text not in self.out.decode(errors="replace"):
            await self.changed.wait()


def _children_of_demo(tmp_prefix: str) -> list[int]:
    """Processes still running with the demo's temporary directory in their command line."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if tmp_prefix in cmdline:
                found.append(int(entry.name))
    return found


async def _run_demo(tmp_path: Path, *, interrupt_at: str | None) -> tuple[int, str, str, float]:
    run = Run()
    env = clean_env(TMPDIR=str(tmp_path))  # the demo's temporary directory lands here
    started = time.monotonic()
    with trio.fail_after(180):
        async with trio.open_nursery() as nursery:
            proc = await trio.lowlevel.open_process(
                [str(DEMO)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=env,
                cwd=ROOT,
            )
            assert proc.stdout is not None and proc.stderr is not None
            nursery.start_soon(run.pump, proc.stdout, "out")
            nursery.start_soon(run.pump, proc.stderr, "err")
            if interrupt_at is not None:
                await run.until(interrupt_at)
                proc.send_signal(signal.SIGINT)
                started = time.monotonic()
            code = await proc.wait()
    return (
        code,
        run.out.decode(errors="replace"),
        run.err.decode(errors="replace"),
        time.monotonic() - started,
    )


async def test_demo_runs_every_step_and_exits_0(tmp_path: Path) -> None:
    code, out, err, _ = await _run_demo(tmp_path, interrupt_at=None)
    assert code == 0, out[-3000:] + err
    assert "Traceback" not in out + err, out + err
    for step in ("worker card", STREAMED, "a completion cancelled after 5 tokens", "SIGTERM to the sidecar"):
        assert f"== {step}" in out or step in out, (step, out)
    # the streamed text is the line after the step's title: tokens only, no log line inside
    lines = out.splitlines()
    text = lines[next(i for i, line in enumerate(lines) if STREAMED in line) + 1]
    assert text.strip() and not LOG_LINE.search(text), text
    assert "Abort(demo-cancel) x1" in out and "leaked 0" in out, out
    assert "sidecar exited with status 0" in out, out
    assert not _children_of_demo(str(tmp_path)), "the demo left a child running"


async def test_ctrl_c_stops_the_demo_with_one_line(tmp_path: Path) -> None:
    code, out, err, took = await _run_demo(tmp_path, interrupt_at=STREAMED)
    assert code == 130, out[-2000:] + err
    assert took < 10, took
    assert "Traceback" not in out + err, out + err
    assert [line for line in err.splitlines() if line.strip()][-1:] == [
        "demo: interrupted; the engine and the sidecar are stopped"
    ], err
    assert not _children_of_demo(str(tmp_path)), "the demo left a child running"
