"""Generate the Grafana dashboard deploy/grafana/openengine-sidecar.json (run after changing this file).

    .venv/bin/python deploy/grafana/generate.py          # rewrite the dashboard
    .venv/bin/python deploy/grafana/generate.py --check  # exit 1 if it is stale (tests run this)

The panels are what an operator looks at first (docs/OBSERVABILITY.md), on Prometheus' scrape of
every sidecar's /metrics. Every query is split or filtered by instance and by engine role: the
series are joined on (job, instance) with ``openengine_sidecar_engine_info`` (one series per
sidecar, labelled with its engine's role), which the ``instance`` and ``role`` variables filter.
``tests/deploy/test_prometheus.py`` runs every query against a real Prometheus scraping a
loaded sidecar: each must return data.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
OUT = HERE / "openengine-sidecar.json"

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
INFO = 'openengine_sidecar_engine_info{instance=~"$instance", role=~"$role"}'
RATE = "$__rate_interval"
NOT_COMPLETED = 'openengine_sidecar_streams_total{outcome!="completed"}'


def joined(series: str) -> str:
    """``series`` with the ``role`` label of its sidecar, filtered by the dashboard's variables."""
    return f"({series}) * on (job, instance) group_left (role) {INFO}"


def rate(metric: str) -> str:
    return joined(f"rate({metric}[{RATE}])")


def quantile(q: float, histogram: str) -> str:
    return f"histogram_quantile({q}, sum by (le, role) ({rate(histogram + '_bucket')}))"


@dataclass(frozen=True)
class Panel:
    title: str
    description: str
    #: (PromQL, legend) per target.
    targets: tuple[tuple[str, str], ...]
    unit: str = "short"
    width: int = 8


@dataclass(frozen=True)
class Row:
    title: str
    panels: tuple[Panel, ...]


ROWS = (
    Row(
        "Streams",
        (
            Panel(
                "Streams ended, by outcome",
                "Generate streams ended per second: completed, cancelled (client gone or cancelled,"
                " drain deadline), failed (engine error, broken stream rule, timeout), rejected.",
                (
                    (
                        f"sum by (role, outcome) ({rate('openengine_sidecar_streams_total')})",
                        "{{role}} {{outcome}}",
                    ),
                ),
                "reqps",
            ),
            Panel(
                "Streams not completed, by code",
                "The OpenEngine error code of every stream that did not complete: CANCELLED is a"
                " client's choice; DRAINING, OVERLOADED, INTERNAL and the rest are worth a look.",
                (
                    (
                        f"sum by (role, outcome, code) ({rate(NOT_COMPLETED)})",
                        "{{role}} {{outcome}} {{code}}",
                    ),
                ),
                "reqps",
            ),
            Panel(
                "Active streams",
                "Admitted streams in flight per sidecar (at most --max-streams).",
                (
                    (
                        f"sum by (instance, role) ({joined('openengine_sidecar_active_streams')})",
                        "{{instance}} ({{role}})",
                    ),
                ),
            ),
            Panel(
                "Output tokens relayed",
                "Tokens per second relayed to clients (added per stream every 64 tokens).",
                ((f"sum by (role) ({rate('openengine_sidecar_tokens_relayed_total')})", "{{role}}"),),
            ),
        ),
    ),
    Row(
        "Latency",
        (
            Panel(
                "Time to first token",
                "From admission to the first token relayed: queueing and prefill on the engine,"
                " plus the sidecar (p50 and p99).",
                (
                    (quantile(0.5, "openengine_sidecar_time_to_first_token_seconds"), "p50 {{role}}"),
                    (quantile(0.99, "openengine_sidecar_time_to_first_token_seconds"), "p99 {{role}}"),
                ),
                "s",
                12,
            ),
            Panel(
                "Inter-token latency",
                "Between two token events of a stream (sampled: the first gap, then one in 8).",
                (
                    (quantile(0.5, "openengine_sidecar_inter_token_seconds"), "p50 {{role}}"),
                    (quantile(0.99, "openengine_sidecar_inter_token_seconds"), "p99 {{role}}"),
                ),
                "s",
                12,
            ),
        ),
    ),
    Row(
        "Engine",
        (
            Panel(
                "Ready",
                "1 while /ready answers 200 (engine healthy, not draining); 0: routers send no work.",
                ((joined("openengine_sidecar_ready"), "{{instance}} ({{role}})"),),
            ),
            Panel(
                "Engine requests",
                "Running and queued requests on the engine, from its GetLoad (every --load-interval).",
                (
                    (
                        f"sum by (instance, role) ({joined('openengine_engine_running_requests')})",
                        "running {{instance}} ({{role}})",
                    ),
                    (
                        f"sum by (instance, role) ({joined('openengine_engine_queued_requests')})",
                        "queued {{instance}} ({{role}})",
                    ),
                ),
            ),
            Panel(
                "KV cache usage",
                "KV blocks in use out of the engine's total, per DP rank.",
                (
                    (
                        f"sum by (instance, role, rank) ({joined('openengine_engine_kv_blocks_used')})"
                        f" / sum by (instance, role, rank) ({joined('openengine_engine_kv_blocks_total')})",
                        "{{instance}} rank {{rank}} ({{role}})",
                    ),
                ),
                "percentunit",
            ),
            Panel(
                "Engine health checks",
                "Health calls by result (slow: past --call-timeout; two in a row turn the worker"
                " not ready), and times the engine came back after being lost.",
                (
                    (
                        f"sum by (instance, result) ({rate('openengine_sidecar_health_checks_total')})",
                        "{{instance}} {{result}}",
                    ),
                    (
                        f"sum by (instance) ({rate('openengine_sidecar_engine_reconnects_total')})",
                        "{{instance}} reconnects",
                    ),
                ),
                "ops",
                24,
            ),
        ),
    ),
    Row(
        "Aborts",
        (
            Panel(
                "Aborts by result",
                "Aborts sent for streams that ended early: aborted, already_finished, not_found;"
                " failed and dropped mean the engine may still run the request.",
                (
                    (
                        f"sum by (role, result) ({rate('openengine_sidecar_aborts_total')})",
                        "{{role}} {{result}}",
                    ),
                ),
                "ops",
            ),
            Panel(
                "Abort retries and confirmations",
                "Abort attempts retried (the engine did not answer), and NOT_FOUND answers"
                " confirmed later by result (aborted: the request had arrived after its Abort).",
                (
                    (f"sum by (role) ({rate('openengine_sidecar_abort_retries_total')})", "retries {{role}}"),
                    (
                        f"sum by (role, result) ({rate('openengine_sidecar_abort_confirmations_total')})",
                        "confirmed {{result}} {{role}}",
                    ),
                ),
                "ops",
            ),
            Panel(
                "Aborts waiting for the engine",
                "Aborts kept after --abort-retry-window for an unreachable engine, re-sent once it answers.",
                (
                    (
                        f"sum by (instance, role) ({joined('openengine_sidecar_aborts_undelivered')})",
                        "{{instance}} ({{role}})",
                    ),
                ),
            ),
        ),
    ),
    Row(
        "KV event bridge",
        (
            Panel(
                "KV publish lag",
                "Publish time minus the engine's batch timestamp, last batch per DP rank.",
                (
                    (
                        f"max by (instance, rank) ({joined('openengine_sidecar_kv_lag_seconds')})",
                        "{{instance}} rank {{rank}}",
                    ),
                ),
                "s",
            ),
            Panel(
                "KV gaps, replays and resyncs",
                "Sequence gaps in the engine's events, replays asked to fill them (by outcome), and"
                " AllBlocksCleared published when history was lost (by reason).",
                (
                    (f"sum by (instance) ({rate('openengine_sidecar_kv_gaps_total')})", "gaps {{instance}}"),
                    (
                        f"sum by (instance, outcome) ({rate('openengine_sidecar_kv_replays_total')})",
                        "replays {{outcome}} {{instance}}",
                    ),
                    (
                        f"sum by (instance, reason) ({rate('openengine_sidecar_kv_resyncs_total')})",
                        "resyncs {{reason}} {{instance}}",
                    ),
                ),
                "ops",
            ),
            Panel(
                "KV events published",
                "KV events per second published to routers, per DP rank.",
                (
                    (
                        f"sum by (instance, rank) ({rate('openengine_sidecar_kv_events_out_total')})",
                        "{{instance}} rank {{rank}}",
                    ),
                ),
            ),
        ),
    ),
    Row(
        "Sidecar process",
        (
            Panel(
                "Event-loop lag",
                "How late the sidecar's one event loop woke (p99), and stalls over 1 s: while it"
                " cannot run, every client and probe sees a hung sidecar.",
                (
                    (
                        f"histogram_quantile(0.99, sum by (le, instance) "
                        f"({rate('openengine_sidecar_event_loop_lag_seconds_bucket')}))",
                        "p99 {{instance}}",
                    ),
                    (
                        f"sum by (instance) ({rate('openengine_sidecar_event_loop_stalls_total')})",
                        "stalls {{instance}}",
                    ),
                ),
                "s",
            ),
            Panel(
                "Draining",
                "1 while the sidecar drains (after SIGTERM): new work is refused DRAINING, admitted"
                " streams get --drain-timeout to finish.",
                ((joined("openengine_sidecar_draining"), "{{instance}} ({{role}})"),),
            ),
            Panel(
                "Trace spans",
                "With tracing on: spans exported, dropped at the full export queue, or refused by"
                " the collector.",
                (
                    (
                        f"sum by (instance, result) ({rate('openengine_sidecar_trace_spans_total')})",
                        "{{instance}} {{result}}",
                    ),
                ),
                "ops",
            ),
        ),
    ),
)


def _variable(name: str, label: str, query: str) -> dict[str, Any]:
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DATASOURCE,
        "definition": query,
        "query": {"query": query, "refId": name},
        "refresh": 2,
        "multi": True,
        "includeAll": True,
        "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "sort": 1,
    }


def _panel(panel: Panel, pid: int, x: int, y: int) -> dict[str, Any]:
    return {
        "id": pid,
        "type": "timeseries",
        "title": panel.title,
        "description": panel.description,
        "datasource": DATASOURCE,
        "gridPos": {"h": 8, "w": panel.width, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
        "options": {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
        "targets": [
            {"refId": chr(ord("A") + i), "datasource": DATASOURCE, "expr": expr, "legendFormat": legend}
            for i, (expr, legend) in enumerate(panel.targets)
        ],
    }


def dashboard() -> dict[str, Any]:
    panels: list[dict[str, Any]] = []
    pid, y = 1, 0
    for row in ROWS:
        panels.append(
            {
                "id": pid,
                "type": "row",
                "title": row.title,
                "collapsed": False,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
                "panels": [],
            }
        )
        pid, y, x = pid + 1, y + 1, 0
        for panel in row.panels:
            if x + panel.width > 24:
                x, y = 0, y + 8
            panels.append(_panel(panel, pid, x, y))
            pid, x = pid + 1, x + panel.width
        y += 8
    return {
        "title": "openengine-sidecar",
        "uid": "openengine-sidecar",
        "description": "Streams, latency, engine load, Aborts, KV bridge and the sidecar process,"
        " per instance and engine role (docs/OBSERVABILITY.md).",
        "tags": ["openengine", "inference"],
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": 39,
        "version": 1,
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "30s",
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Data source",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {},
                },
                _variable("instance", "Instance", "label_values(openengine_sidecar_engine_info, instance)"),
                _variable(
                    "role",
                    "Engine role",
                    'label_values(openengine_sidecar_engine_info{instance=~"$instance"}, role)',
                ),
            ]
        },
        "annotations": {"list": []},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is stale: run python deploy/grafana/generate.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
