"""Small statistics for the benchmark (I/O-free): percentiles, summaries, /proc parsing."""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Sequence
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def pct(values: Sequence[float], p: float) -> float:
    """The ``p``-th percentile (0..100), linear interpolation; NaN when empty."""
    if not values:
        return math.nan
    s = sorted(values)
    if len(s) == 1:
        return float(s[0])
    k = (len(s) - 1) * p / 100.0
    lo = math.floor(k)
    hi = min(lo + 1, len(s) - 1)
    return float(s[lo] + (s[hi] - s[lo]) * (k - lo))


def summary(values: Sequence[float], scale: float = 1.0) -> dict[str, float]:
    """count, p50, p90, p99, max and mean of ``values`` (each multiplied by ``scale``)."""
    if not values:
        return {
            "count": 0,
            "p50": math.nan,
            "p90": math.nan,
            "p99": math.nan,
            "max": math.nan,
            "mean": math.nan,
        }
    s = sorted(values)
    return {
        "count": len(s),
        "p50": pct(s, 50) * scale,
        "p90": pct(s, 90) * scale,
        "p99": pct(s, 99) * scale,
        "max": s[-1] * scale,
        "mean": statistics.fmean(s) * scale,
    }


def added(through: dict[str, float], direct: dict[str, float]) -> dict[str, float]:
    """Percentile-wise difference of two summaries (what the relay adds to each percentile)."""
    return {k: through[k] - direct[k] for k in ("p50", "p90", "p99", "max", "mean") if k in through}


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


def parse_stat_cpu(text: str) -> float:
    """utime + stime in seconds from the text of ``/proc/PID/stat``."""
    fields = text.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def cpu_seconds(pid: int | str = "self") -> float:
    """CPU time (user + system, all threads) a process has used so far."""
    return parse_stat_cpu(Path(f"/proc/{pid}/stat").read_text())


def parse_status_kib(text: str, key: str = "VmRSS") -> int:
    """A ``kB`` figure (e.g. ``VmRSS``) from the text of ``/proc/PID/status``."""
    for line in text.splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def rss_kib(pid: int | str = "self") -> int:
    return parse_status_kib(Path(f"/proc/{pid}/status").read_text())


def fmt(value: float | None, digits: int = 0) -> str:
    """A number for tables: thousands separators, ``-`` for NaN/None."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:,.{digits}f}"
