"""``scripts/soak --report CSV``: an earlier run's rounds summarised again (the table in
docs/results/soak-runs.md comes from it); a leaked round makes it exit 1."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

SOAK = Path(__file__).resolve().parents[2] / "scripts" / "soak"

FIELDS = {
    "round": 0,
    "elapsed_s": 5.0,
    "fault": "",
    "streams": 1000,
    "completed": 600,
    "cancelled": 250,
    "lost_on_dropped_connections": 150,
    "other": 0,
    "events": 5000,
    "peak_open": 900,
    "seconds": 4.0,
    "violations": 0,
    "failed_retryable": 0,
    "engine_answered": 1,
    "engine_leaked": 0,
    "engine_in_flight": 0,
    "orphans_expired": 0,
    "sidecar_ready": 1,
    "ready_again_after_s": 0.0,
    "sidecar_active": 0,
    "sidecar_connections": 0,
    "abort_retries": 0,
    "keepalive_timeouts": 0,
    "engine_reconnects": 0,
    "dynamo_routable": 1,
    "sidecar_rss_kib": 100_000,
    "sidecar_fds": 80,
    "engine_rss_kib": 60_000,
}


def run_report(tmp_path: Path, rows: list[dict[str, object]]) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "soak.csv"
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(FIELDS))
        writer.writeheader()
        writer.writerows(rows)
    return subprocess.run(
        [sys.executable, str(SOAK), "--report", str(path)], capture_output=True, text=True, timeout=60
    )


def test_clean_rounds_pass_and_are_grouped_by_fault(tmp_path: Path) -> None:
    rows = [
        {**FIELDS, "round": 0},
        {
            **FIELDS,
            "round": 1,
            "fault": "kill",
            "completed": 100,
            "other": 700,
            "failed_retryable": 700,
            "lost_on_dropped_connections": 0,
            "sidecar_ready": 0,
            "ready_again_after_s": 0.4,
        },
        {**FIELDS, "round": 2, "sidecar_rss_kib": 101_024},
    ]
    done = run_report(tmp_path, rows)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "3 rounds, 3000 streams" in done.stdout and "rounds with a leak or violation: 0" in done.stdout
    assert "| no fault | 2 | 2,000 | 1,200 |" in done.stdout
    assert (
        "| kill | 1 | 1,000 | 100 | 250 | 0 | 700 | 0 | 0 | 0 / 0 / 0 | 0 / 0 | 1 (0.4 s) | 4 s | 0 |"
        in done.stdout
    )


def test_a_round_with_an_expired_orphan_or_another_error_is_bad(tmp_path: Path) -> None:
    rows = [
        {**FIELDS, "round": 0},
        {**FIELDS, "round": 1, "fault": "partition", "orphans_expired": 2},
        {**FIELDS, "round": 2, "other": 3, "failed_retryable": 1},
    ]
    done = run_report(tmp_path, rows)
    assert done.returncode == 1
    assert "rounds with a leak or violation: 2" in done.stdout
    assert (
        "| partition | 1 | 1,000 | 600 | 250 | 150 | 0 | 0 | 0 | 0 / 0 / 2 | 0 / 0 | 0 (0 s) | 4 s | 1 |"
        in done.stdout
    )
    assert "| no fault | 2 | 2,000 | 1,200 | 500 | 300 | 1 | 2 | 0 |" in done.stdout


def test_rss_after_the_settling_minutes_and_the_longest_round_are_reported(tmp_path: Path) -> None:
    rows = [
        {**FIELDS, "round": 0, "sidecar_rss_kib": 90_000},
        {**FIELDS, "round": 1, "elapsed_s": 600.0, "sidecar_rss_kib": 120_000},  # before minute 20
        {**FIELDS, "round": 2, "elapsed_s": 1200.0, "fault": "kill", "seconds": 600.5},
        {**FIELDS, "round": 3, "elapsed_s": 2100.0, "sidecar_rss_kib": 100_512},
        {**FIELDS, "round": 4, "elapsed_s": 3000.0, "sidecar_rss_kib": 101_024},
    ]
    done = run_report(tmp_path, rows)
    assert done.returncode == 0, done.stdout + done.stderr
    # +1 MiB between minute 20 and minute 50: +2 MiB per hour
    assert (
        "sidecar RSS from minute 20 (3 rounds, 30 minutes): first 97.7 MiB, last 98.7, "
        "lowest 97.7, highest 98.7, slope +2.00 MiB/hour" in done.stdout
    )
    assert (
        "| kill | 1 | 1,000 | 600 | 250 | 150 | 0 | 0 | 0 | 0 / 0 / 0 | 0 / 0 | 0 (0 s) | 600.5 s | 0 |"
        in done.stdout
    )
