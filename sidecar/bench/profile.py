"""Profiles of benchmark processes: py-spy recording and a summary of its collapsed stacks.

``record(pid, seconds, out)`` starts ``py-spy record --format raw`` on a process (py-spy
is optional: ``pip install py-spy``; it needs ptrace rights). ``summarize(text)`` turns
the collapsed stacks (``frame;frame;... count`` per line) into the top functions by self
time and by inclusive time — I/O-free, unit-tested.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^():]+)(?::\d+)?\)$")


def py_spy() -> str | None:
    """The py-spy executable (next to the running Python first), or None."""
    local = Path(sys.executable).with_name("py-spy")
    return str(local) if local.exists() else shutil.which("py-spy")


def record(pid: int, seconds: float, out: Path, *, rate: int = 250) -> subprocess.Popen[bytes] | None:
    """Start recording ``pid`` for ``seconds``; returns the py-spy process (None: no py-spy)."""
    exe = py_spy()
    if exe is None:
        return None
    argv = [exe, "record", "--pid", str(pid), "--rate", str(rate), "--duration", str(max(1, int(seconds)))]
    return subprocess.Popen(
        [*argv, "--format", "raw", "--output", str(out)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _short(frame: str) -> str:
    """``func (path/to/pkg/mod.py:12)`` -> ``func (pkg/mod.py)``."""
    m = _FRAME.match(frame.strip())
    if m is None:
        return frame.strip()
    path = m.group("file")
    parts = path.replace("\\", "/").split("/")
    for anchor in ("site-packages", "lib", "sidecar"):
        if anchor in parts[:-1]:
            i = len(parts) - 1 - parts[::-1].index(anchor)
            parts = parts[i + 1 :] if anchor != "sidecar" else parts[i:]
            break
    else:
        parts = parts[-2:]
    return f"{m.group('func')} ({'/'.join(parts)})"


def parse_collapsed(text: str) -> list[tuple[list[str], int]]:
    """Collapsed stack lines -> (frames root..leaf, sample count)."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        frames = [_short(f) for f in stack.split(";") if f]
        frames = [f for f in frames if not f.startswith("process ") and not f.startswith("thread ")]
        out.append((frames, int(count)))
    return out


def summarize(text: str, top: int = 25) -> dict[str, Any]:
    """Top functions by self samples and by inclusive samples (each as a share of all samples)."""
    stacks = parse_collapsed(text)
    total = sum(c for _, c in stacks)
    self_c: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    for frames, count in stacks:
        if frames:
            self_c[frames[-1]] += count
        for f in set(frames):
            incl[f] += count

    def rows(counter: Counter[str]) -> list[dict[str, Any]]:
        return [
            {"function": f, "samples": n, "share": n / total if total else 0.0}
            for f, n in counter.most_common(top)
        ]

    return {"samples": total, "self": rows(self_c), "inclusive": rows(incl)}


def render(summary: dict[str, Any], top: int = 20) -> str:
    lines = [f"{summary['samples']} samples", "  self%  incl%  function"]
    incl = {r["function"]: r["share"] for r in summary["inclusive"]}
    for r in summary["self"][:top]:
        share = incl.get(r["function"])
        lines.append(
            f"  {r['share'] * 100:5.1f}  {'' if share is None else f'{share * 100:5.1f}':>5}  {r['function']}"
        )
    return "\n".join(lines)
