"""The alert rules and the Grafana dashboard of deploy/, checked by Prometheus' own tools.

- ``promtool check`` takes the rules and the example scrape configuration; ``promtool test
  rules`` (``alert_rules_test.yaml``) fires each alert on the series that mean it.
- Every metric a rule or a panel names is one the sidecar exports.
- A real Prometheus scrapes a real sidecar (in front of a simulated engine, both processes)
  while a load runs, loads the rules (each evaluates without error) and answers every panel's
  query with data: a renamed metric, a wrong label or a broken join fails here.
"""

from __future__ import annotations

import importlib
import json
import math
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import yaml

from sidecar.metrics_registry import REGISTRY
from tests.deploy.helpers import DEPLOY
from tests.e2e.harness import generate_request, mock_engine, sidecar, spawn_argv
from tests.otlp_receiver import otlp_receiver
from tests.polling import eventually
from tests.prereq import require_tool

RULES = DEPLOY / "prometheus" / "openengine-sidecar-alerts.yaml"
CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
RULE_TESTS = Path(__file__).with_name("alert_rules_test.yaml")
DASHBOARD = DEPLOY / "grafana" / "openengine-sidecar.json"
GENERATE = DEPLOY / "grafana" / "generate.py"
#: Modules that register metrics when imported (the run command imports them all).
METRIC_MODULES = (
    "sidecar.core.metrics",
    "sidecar.core.load_metrics",
    "sidecar.kvbridge.metrics",
    "sidecar.dynamo.metrics",
    "sidecar.loopwatch",
    "sidecar.tracing",
)
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}


def promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    tool = require_tool("promtool")
    return subprocess.run([tool, *args], capture_output=True, text=True, timeout=60, cwd=cwd)


def series_names() -> set[str]:
    """Every series name the sidecar can export (as Prometheus stores it)."""
    for module in METRIC_MODULES:
        importlib.import_module(module)
    return {f.name + s for f in REGISTRY.collect() for s in SUFFIXES.get(f.type, ("",))}


def alert_rules() -> list[dict[str, Any]]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def panel_targets() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every query of the dashboard."""
    dash = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in dash["panels"] if p["type"] != "row" for t in p["targets"]]


def names_in(expr: str) -> set[str]:
    return set(re.findall(r"\bopenengine_[a-z_]+[a-z]\b", expr))


# -- static checks --------------------------------------------------------------------------


def test_promtool_accepts_the_rules_and_the_example_configuration() -> None:
    rules = promtool("check", "rules", str(RULES))
    assert rules.returncode == 0, rules.stdout + rules.stderr
    config = promtool("check", "config", str(CONFIG))
    assert config.returncode == 0, config.stdout + config.stderr


def test_every_alert_fires_on_what_it_means(tmp_path: Path) -> None:
    """``promtool test rules`` on a copy of the rules without annotations (promtool compares them
    whole; their templates are checked by ``promtool check rules``)."""
    doc = yaml.safe_load(RULES.read_text())
    for group in doc["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations")
    (tmp_path / RULES.name).write_text(yaml.safe_dump(doc))
    (tmp_path / RULE_TESTS.name).write_text(RULE_TESTS.read_text())
    result = promtool("test", "rules", RULE_TESTS.name, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    tested = set(re.findall(r"alertname: (\w+)", RULE_TESTS.read_text()))
    assert tested == {r["alert"] for r in alert_rules()}, "every alert has a promtool test"


def test_every_alert_says_what_to_do() -> None:
    for rule in alert_rules():
        assert rule["labels"]["severity"] in ("critical", "warning", "info"), rule["alert"]
        assert rule["annotations"]["summary"] and len(rule["annotations"]["description"]) > 100, rule["alert"]


def test_rules_and_panels_name_only_series_the_sidecar_exports() -> None:
    exported = series_names()
    named = {name for r in alert_rules() for name in names_in(r["expr"])}
    named |= {name for _, expr in panel_targets() for name in names_in(expr)}
    assert named - exported == set()
    assert len(named) > 25


def test_the_dashboard_is_generated_from_its_script() -> None:
    result = subprocess.run(
        [sys.executable, str(GENERATE), "--check"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr


# -- a real Prometheus on a real sidecar ------------------------------------------------------

SCRAPE = """
global:
  scrape_interval: 1s
  evaluation_interval: 1s
rule_files:
  - {rules}
scrape_configs:
  - job_name: openengine-sidecar
    static_configs:
      - targets: ["{target}"]
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def concrete(expr: str) -> str:
    """A panel's query as Grafana sends it with every instance and role selected."""
    return expr.replace("$__rate_interval", "15s").replace("$instance", ".*").replace("$role", ".*")


async def load(ws: str, stop: trio.Event) -> None:
    """Streams until ``stop``: most complete, one in four is cancelled at once (before the
    engine registered it: its Abort answered NOT_FOUND is confirmed later)."""
    from sidecar.client.sidecar_client import open_sidecar

    async with open_sidecar(ws) as client:

        async def worker(w: int) -> None:
            n = 0
            while not stop.is_set():
                n += 1
                async with client.generate(generate_request(f"load {w} {n} " * 4, max_tokens=24)) as s:
                    if n % 4 == 0:
                        await s.cancel()
                    async for _ in s:
                        pass

        async with trio.open_nursery() as nursery:
            for w in range(4):
                nursery.start_soon(worker, w)


async def query(client: httpx.AsyncClient, base: str, expr: str) -> list[dict[str, Any]]:
    resp = await client.get(f"{base}/api/v1/query", params={"query": expr})
    body = resp.json()
    assert body["status"] == "success", (expr, body)
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


def has_data(result: list[dict[str, Any]]) -> bool:
    return any(not math.isnan(float(r["value"][1])) for r in result)


@pytest.mark.subprocess
async def test_a_real_prometheus_answers_every_panel_with_data(aio_loop: Any, tmp_path: Path) -> None:
    """The simulated engine makes every kind of series appear: requests registered late (so an
    immediately cancelled stream's Abort is confirmed), a KV event gap (replayed) and lost KV
    history (cleared); the sidecar traces to an OTLP receiver."""
    prometheus = require_tool("prometheus")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    faults = ("--fault", "late-generate=0.2", "--fault", "kv-gap=2", "--fault", "kv-history-lost=6")
    with otlp_receiver() as rx, trio.fail_after(120):
        async with (
            mock_engine(tmp_path, "--token-delay-ms", "5", *faults) as engine,
            sidecar(engine.address, "--otlp-endpoint", rx.url) as sc,
        ):
            target = sc.http.removeprefix("http://")
            (tmp_path / "prometheus.yml").write_text(SCRAPE.format(rules=RULES, target=target))
            argv = [
                prometheus,
                f"--config.file={tmp_path / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ]
            stop = trio.Event()
            async with (
                spawn_argv(argv, label="prometheus"),
                httpx.AsyncClient(timeout=5) as client,
                trio.open_nursery() as nursery,
            ):

                async def ready() -> bool:
                    try:
                        return (await client.get(f"{base}/-/ready")).status_code == 200
                    except httpx.TransportError:
                        return False

                await eventually(ready, timeout=30, interval=0.2)
                nursery.start_soon(load, sc.ws, stop)
                targets = panel_targets()
                missing: list[str] = []

                async def all_answered() -> bool:
                    missing.clear()
                    for title, expr in targets:
                        if not has_data(await query(client, base, concrete(expr))):
                            missing.append(f"{title}: {expr}")
                    return not missing

                try:
                    await eventually(all_answered, timeout=60, interval=1)
                except trio.TooSlowError:
                    pytest.fail("panels without data:\n" + "\n".join(missing))
                [up] = await query(client, base, 'up{job="openengine-sidecar"}')
                assert up["value"][1] == "1"
                [info] = await query(client, base, "openengine_sidecar_engine_info")
                assert info["metric"]["role"] == "aggregated" and info["metric"]["engine"] == "vllm"
                rules = (await client.get(f"{base}/api/v1/rules")).json()["data"]["groups"]
                evaluated = [r for g in rules for r in g["rules"]]
                assert {r["name"] for r in evaluated} == {r["alert"] for r in alert_rules()}
                assert {r["health"] for r in evaluated} == {"ok"}, [
                    r for r in evaluated if r["health"] != "ok"
                ]
                stop.set()
