"""The ``openai`` scenario: a quick real run (processes, the front and EngineClient on one paced
engine), its comparison and its rows (the figures depend on the machine, not checked here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sidecar.bench import analysis, report
from sidecar.bench.openai_bench import _compare

pytestmark = pytest.mark.subprocess


def test_a_quick_openai_run(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    done = subprocess.run(
        [sys.executable, "-m", "sidecar", "bench", "--quick", "--scenarios", "openai", "--out", str(out)],
        capture_output=True,
        check=False,
        stdin=subprocess.DEVNULL,
        timeout=300,
    )
    stdout = done.stdout.decode()
    assert done.returncode == 0, stdout[-3000:] + done.stderr.decode()[-3000:]
    doc = json.loads(out.read_text())
    assert doc["errors"] == {}, doc["errors"]
    sim = doc["results"]["openai"]["simulated"]
    assert set(sim) == {"1", "64"}
    for n, fig in sim.items():
        for side in ("front", "reference"):
            assert fig[side]["tokens"] == int(n) * 10 and fig[side]["short_streams"] == 0, (n, side)
    assert "OpenAI front (streamed)" in stdout and "OpenAI front added TTFT p50, 64 stream(s)" in stdout


def _run(ttft: float, tps: float) -> dict[str, object]:
    pct = {"p50": ttft, "p99": ttft * 2}
    return {
        "tokens_per_s": tps,
        "ttft_ms": pct,
        "itl_ms": {"p50": 1.0, "p99": 2.0},
        "short_streams": 0,
        "cpu_s": {"self": 0.1, "sidecar": 0.2},
        "tokens": 100,
    }


def test_the_comparison_pairs_rounds_and_feeds_the_goals() -> None:
    fig = _compare([_run(12.0, 95.0), _run(20.0, 97.0)], [_run(11.0, 100.0), _run(16.0, 100.0)])
    assert fig["added_ttft_p50_ms"] == 2.5  # median of the paired differences (1, 4)
    assert fig["tokens_per_s_ratio"] == 0.96
    results = {"openai": {"simulated": {"64": fig}, "vllm": {"skipped": "no extra"}}}
    (row,) = report.openai_rows(results)
    assert row[0].startswith("simulated engine, 64 streams") and row[3] == "+2.50" and row[4] == "0.96x"
    goals = {g["goal"]: g["met"] for g in analysis.goals(results)}
    assert goals["OpenAI front added TTFT p50, 64 stream(s)"] is False
    assert goals["OpenAI front tokens/s vs EngineClient, 64 stream(s)"] is True
