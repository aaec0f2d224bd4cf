"""A smoke run of ``openengine-sidecar bench --quick``: every scenario, tiny sizes, real processes.

It checks the benchmark works end to end (not the figures, which depend on the machine):
every scenario reports, the relay delivered every token on all three clients, the storm
leaked nothing, the drain exited cleanly, and the JSON holds the machine description.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import trio


async def test_quick_bench_runs_every_scenario(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    with trio.fail_after(240):
        done = await trio.run_process(
            [sys.executable, "-m", "sidecar", "bench", "--quick", "--out", str(out)],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
            stdin=subprocess.DEVNULL,
        )
    stdout = done.stdout.decode()
    assert done.returncode == 0, stdout[-3000:] + done.stderr.decode()[-3000:]
    assert "| goal" in stdout and "relay tokens/s" in stdout and "[" in stdout.splitlines()[0]
    doc = json.loads(out.read_text())
    assert doc["errors"] == {}, doc["errors"]
    results = doc["results"]
    assert set(results) == {"relay", "short", "latency", "cancel", "scale", "kv", "drain"}

    relay = results["relay"]
    cfg = relay["config"]
    for kind in ("sidecar", "engineclient", "grpcio"):
        (run,) = relay["runs"][kind]
        assert run["tokens"] == cfg["streams"] * cfg["tokens"], kind
    assert relay["runs"]["sidecar"][0]["outcomes"] == {"completed": cfg["streams"]}
    assert relay["sidecar"]["sidecar_cpu_us_per_token"] > 0
    assert relay["grpcio"]["client_cpu_us_per_token"] > 0

    assert results["short"]["sidecar"]["completed"] > 0
    assert results["latency"]["sidecar"]["oneway_ms"]["count"] > 0
    assert results["latency"]["engineclient"]["oneway_ms"]["count"] > 0

    for kind in ("sidecar", "engineclient"):
        storm = results["cancel"][kind]
        assert storm["leaked"] == 0, kind
        assert storm["latency_ms"]["count"] > 0, kind

    (point,) = results["scale"]["points"]
    assert point["engine_streams_open"] == point["streams"]
    assert point["leaked_after_close"] == 0

    assert results["kv"]["blast"]["lost_batches"] == 0

    drain = results["drain"]
    assert drain["exit_code"] == 0 and drain["leaked"] == 0
    assert sum(drain["outcomes"].values()) == drain["streams"]

    machine = doc["machine"]
    assert machine["cores"] and machine["python"] and machine["packages"]["trio"]
    assert {g["goal"] for g in doc["goals"]} >= {"relay vs direct EngineClient", "cancel → engine p99"}
