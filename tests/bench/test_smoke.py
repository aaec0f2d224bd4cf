"""A smoke run of ``openengine-sidecar bench --quick``: every scenario, tiny sizes, real processes.

It checks the benchmark works end to end (not the figures, which depend on the machine):
every scenario reports, the relay delivered every token on all three clients, every burst
client got every stream, the storm leaked nothing, the drain exited cleanly, the fleet path
served every request through Dynamo's frontend on all three workers, and the JSON holds the
machine description. The run is shared by the tests of this module.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from sidecar.bench.config import SCENARIOS

pytestmark = pytest.mark.subprocess


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, Any]]:
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    done = subprocess.run(
        [sys.executable, "-m", "sidecar", "bench", "--quick", "--out", str(out)],
        capture_output=True,
        check=False,
        stdin=subprocess.DEVNULL,
        timeout=360,
    )
    stdout = done.stdout.decode()
    assert done.returncode == 0, stdout[-3000:] + done.stderr.decode()[-3000:]
    return stdout, json.loads(out.read_text())


def test_quick_bench_runs_every_scenario(quick_run: tuple[str, dict[str, Any]]) -> None:
    stdout, doc = quick_run
    assert "| goal" in stdout and "relay tokens/s" in stdout and "[" in stdout.splitlines()[0]
    assert doc["errors"] == {}, doc["errors"]
    results = doc["results"]
    assert (
        set(results)
        == set(SCENARIOS)
        == {
            "relay",
            "short",
            "burst",
            "latency",
            "cancel",
            "scale",
            "kv",
            "drain",
            "dynamo",
        }
    )

    relay = results["relay"]
    cfg = relay["config"]
    for kind in ("sidecar", "engineclient", "grpcio"):
        (run,) = relay["runs"][kind]
        assert run["tokens"] == cfg["streams"] * cfg["tokens"], kind
    assert relay["runs"]["sidecar"][0]["outcomes"] == {"completed": cfg["streams"]}
    assert relay["sidecar"]["sidecar_cpu_us_per_token"] > 0
    assert relay["grpcio"]["client_cpu_us_per_token"] > 0

    short = results["short"]
    for kind in ("sidecar", "engineclient", "grpcio"):
        assert short[kind]["completed"] > 0, kind
    assert short["cpu_per_request_vs_grpcio"] is None or short["cpu_per_request_vs_grpcio"] > 0

    burst = results["burst"]
    (size,) = burst["config"]["sizes"]
    fig = burst["sizes"][str(size)]
    assert fig["reference"] == "grpcio"
    assert set(fig["clients"]) == {"json", "lean-coalesced", "lean", "grpcio", "engineclient"}
    for kind, f in fig["clients"].items():
        assert f["completed"] == f["expected"] == size, kind
        assert f["ttft_ms"]["count"] == size, kind
    assert "burst: streams at once" in stdout
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


@pytest.mark.dynamo  # the dynamo scenario reports "skipped" without the extra
def test_quick_bench_runs_the_fleet_path(quick_run: tuple[str, dict[str, Any]]) -> None:
    stdout, doc = quick_run
    dyn = doc["results"]["dynamo"]
    assert "skipped" not in dyn, dyn
    cfg = dyn["config"]
    for kind in ("sidecar", "anchor", "mocker"):
        (run,) = dyn["runs"][kind]
        assert run["errors"] == 0 and run["completed"] == cfg["requests"], (kind, run)
        assert run["out_tokens"] == cfg["requests"] * cfg["tokens"], kind
    assert dyn["ratios"]["ttft_p50_minus_anchor_ms"] is not None
    assert "Dynamo fleet path" in stdout
    for kind in ("sidecar", "anchor"):  # the paced rounds: the same open-loop rate for both
        (run,) = dyn["paced_runs"][kind]
        assert (
            run["errors"] == 0 and run["completed"] == cfg["requests"] and run["rate"] == dyn["paced"]["rate"]
        )
    assert dyn["paced"]["ratios"]["ttft_p50_minus_anchor_ms"] is not None
    assert "(open loop): TTFT p50" in stdout
