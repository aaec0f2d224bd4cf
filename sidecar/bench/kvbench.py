"""KV bridge scenario: the processes of ``scripts/bench-kvbridge``, driven for a JSON result.

The measured code path is that script's (an engine-like ZMQ publisher, the bridge
``run_kv_bridge`` in its own process, a direct and a bridged subscriber); this module only
runs two of its phases — a blast (throughput: events per bridge CPU-second and the output
rate) and one paced phase (added latency per batch: bridged minus direct receive time) —
and returns the figures instead of printing a table. Synchronous; runs in a worker process
(it forks its helpers).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from sidecar.bench import stats

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench-kvbridge"


class KvBenchUnavailable(Exception):
    """scripts/bench-kvbridge is not in this checkout."""


def load_script() -> ModuleType:
    if not SCRIPT.exists():
        raise KvBenchUnavailable(f"{SCRIPT} not found (the KV scenario runs from a source checkout)")
    loader = importlib.machinery.SourceFileLoader("bench_kvbridge", str(SCRIPT))
    spec = importlib.util.spec_from_loader("bench_kvbridge", loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_kvbridge"] = module  # msgspec resolves the script's annotations through it
    loader.exec_module(module)
    return module


def run(spec: dict[str, Any]) -> dict[str, Any]:
    kv = load_script()
    batch = kv.BATCH
    ctx = mp.get_context("fork")
    res: Any = ctx.Queue()
    pub_ctl: Any = ctx.Queue()
    br_ctl: Any = ctx.Queue()
    sub_ctl = {"direct": ctx.Queue(), "bridged": ctx.Queue()}

    def start(target: Any, *args: Any) -> None:
        p = ctx.Process(target=target, args=args, daemon=True, name=target.__name__)
        p.start()
        kv.PROCS.append(p)

    try:
        start(kv.publisher, pub_ctl, res)
        endpoint = kv.expect(res, "endpoint")[1]
        start(kv.bridge, endpoint, br_ctl, res)
        _, out_endpoint, bridge_pid = kv.expect(res, "bridge")
        start(kv.subscriber, "direct", endpoint, sub_ctl["direct"], res)
        start(kv.subscriber, "bridged", out_endpoint, sub_ctl["bridged"], res)
        pub_ctl.put(("warmup",))
        seen: set[str] = set()
        while len(seen) < 2:
            seen.add(kv.expect(res, "subscribed")[1])
        pub_ctl.put(("ready",))
        kv.expect(res, "warm")

        phases = [("blast", spec["batches"], 0), ("paced", int(spec["rate"] * spec["seconds"]), spec["rate"])]
        windows = []
        for name, n, rate in phases:
            cpu0 = stats.cpu_seconds(bridge_pid)
            pub_ctl.put(("run", n, rate))
            _, sent, pub_wall, first_ts, last_ts = kv.expect(res, "sent", timeout=600)
            prev = -1.0
            while True:  # until the bridge is idle again (its CPU clock stops moving)
                time.sleep(0.2)
                now = stats.cpu_seconds(bridge_pid)
                if now == prev:
                    break
                prev = now
            windows.append((name, n, rate, first_ts, last_ts, sent / pub_wall * batch, now - cpu0))
            time.sleep(0.2)

        for q in sub_ctl.values():
            q.put("stop")
        recs: dict[str, list[tuple[float, float, int]]] = {}
        for _ in range(2):
            _, who, records = kv.expect(res, "records", timeout=120)
            recs[who] = records
    finally:
        br_ctl.put("stop")
        pub_ctl.put(("stop",))
        for p in kv.PROCS:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()

    out: dict[str, Any] = {"batch_events": batch}
    for name, n, rate, first_ts, last_ts, pub_rate, cpu in windows:
        direct = [x for x in recs["direct"] if first_ts <= x[0] <= last_ts]
        bridged = [x for x in recs["bridged"] if first_ts <= x[0] <= last_ts]
        direct_at = {x[0]: x[1] for x in direct}
        added = [(x[1] - direct_at[x[0]]) * 1000 for x in bridged if x[0] in direct_at]
        events = n * batch
        out[name] = {
            "batches": n,
            "events": events,
            "target_events_per_s": rate * batch,
            "publisher_events_per_s": pub_rate,
            "direct_events_per_s": kv.rate(direct),
            "bridge_events_per_s": kv.rate(bridged),
            "bridge_cpu_s": cpu,
            "events_per_bridge_cpu_s": events / cpu if cpu > 0 else float("nan"),
            "lost_batches": n - len(bridged),
            "added_latency_ms": stats.summary(added),
            "added_latency_median_ms": statistics.median(added) if added else float("nan"),
        }
    return out
