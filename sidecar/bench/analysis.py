"""Turning raw worker results into the benchmark's figures (I/O-free, unit-tested)."""

from __future__ import annotations

import math
from typing import Any

from sidecar.bench import stats


def per_token_us(cpu_s: float, tokens: int) -> float:
    return cpu_s / tokens * 1e6 if tokens else math.nan


def relay_figures(rounds: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Medians over rounds of each client kind (``sidecar``, ``engineclient``, ``grpcio``):
    tokens/s, CPU µs per token of the sidecar / the client / the engine, and the ratios."""
    out: dict[str, Any] = {}
    for kind, runs in rounds.items():
        if not runs:
            continue
        fig: dict[str, Any] = {
            "tokens_per_s": stats.median([r["tokens_per_s"] for r in runs]),
            "client_cpu_us_per_token": stats.median(
                [per_token_us(r["cpu_s"]["self"], r["tokens"]) for r in runs]
            ),
            "engine_cpu_us_per_token": stats.median(
                [per_token_us(r["cpu_s"].get("engine", math.nan), r["tokens"]) for r in runs]
            ),
            "rounds_tokens_per_s": [r["tokens_per_s"] for r in runs],
        }
        if kind == "sidecar":
            fig["sidecar_cpu_us_per_token"] = stats.median(
                [per_token_us(r["cpu_s"]["sidecar"], r["tokens"]) for r in runs]
            )
            fig["sidecar_cpu_share"] = stats.median([r["cpu_s"]["sidecar"] / r["seconds"] for r in runs])
        out[kind] = fig
    side, ec, grpc = out.get("sidecar"), out.get("engineclient"), out.get("grpcio")
    ratios: dict[str, float] = {}
    if side and ec:
        ratios["throughput_vs_engineclient"] = ratio(side["tokens_per_s"], ec["tokens_per_s"])
    if side and grpc:
        ratios["throughput_vs_grpcio"] = ratio(side["tokens_per_s"], grpc["tokens_per_s"])
        ratios["sidecar_cpu_per_token_vs_grpcio"] = ratio(
            side["sidecar_cpu_us_per_token"], grpc["client_cpu_us_per_token"]
        )
    if ec and grpc:
        ratios["engineclient_cpu_per_token_vs_grpcio"] = ratio(
            ec["client_cpu_us_per_token"], grpc["client_cpu_us_per_token"]
        )
    out["ratios"] = ratios
    return out


def ratio(a: float, b: float) -> float:
    """a / b; NaN when b is zero or unknown (a tiny --quick run can measure 0 CPU ticks)."""
    return a / b if b and not math.isnan(b) else math.nan


def latency_added(through: dict[str, Any], direct: dict[str, Any]) -> dict[str, Any]:
    """What the relay adds to each percentile of TTFT, inter-token gap and one-way latency."""
    return {key: stats.added(through[key], direct[key]) for key in ("ttft_ms", "itl_ms", "oneway_ms")}


def short_figures(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per client kind, medians over rounds: requests/s, latency p50/p99, CPU µs per request
    (the sidecar process through the sidecar, the client process directly); and the ratios."""
    out: dict[str, Any] = {}
    for kind, rs in runs.items():
        if not rs:
            continue
        who = "sidecar" if kind == "sidecar" else "self"
        out[kind] = {
            "requests_per_s": stats.median([r["requests_per_s"] for r in rs]),
            "completed": sum(r["completed"] for r in rs),
            "latency_ms": {p: stats.median([r["latency_ms"][p] for r in rs]) for p in ("p50", "p99")},
            "cpu_us_per_request": stats.median([per_token_us(r["cpu_s"][who], r["completed"]) for r in rs]),
            "client_cpu_us_per_request": stats.median(
                [per_token_us(r["cpu_s"]["self"], r["completed"]) for r in rs]
            ),
            "rounds_requests_per_s": [r["requests_per_s"] for r in rs],
        }
    side, ec, grpc = out.get("sidecar"), out.get("engineclient"), out.get("grpcio")
    if side and ec:
        out["ratio_vs_engineclient"] = ratio(side["requests_per_s"], ec["requests_per_s"])
    if side and grpc:
        out["cpu_per_request_vs_grpcio"] = ratio(side["cpu_us_per_request"], grpc["cpu_us_per_request"])
    return out


#: Burst clients that reach the engine through the sidecar (the others read it directly).
BURST_VIA_SIDECAR = ("json", "lean-coalesced", "lean")


def burst_figures(runs: dict[str, list[dict[str, Any]]], expected: int) -> dict[str, Any]:
    """Per client kind: TTFT summary pooled over every burst of every round, streams completed,
    sidecar CPU per request (through-sidecar kinds); ``added`` = each percentile minus the
    reference's (grpcio, else EngineClient)."""
    clients: dict[str, Any] = {}
    for kind, rs in runs.items():
        if not rs:
            continue
        fig: dict[str, Any] = {
            "ttft_ms": stats.summary([t for r in rs for t in r["ttft_ms"]]),
            "completed": sum(r["ended"] for r in rs),
            "expected": expected,
            "client_cpu_s": sum(r["cpu_s"]["self"] for r in rs),
        }
        if kind in BURST_VIA_SIDECAR:
            fig["sidecar_cpu_us_per_request"] = (
                sum(r["cpu_s"].get("sidecar", math.nan) for r in rs) / expected * 1e6
            )
        clients[kind] = fig
    out: dict[str, Any] = {"clients": clients}
    ref = next((k for k in ("grpcio", "engineclient") if k in clients), None)
    if ref is not None:
        out["reference"] = ref
        for kind, fig in clients.items():
            if kind in BURST_VIA_SIDECAR:
                fig["added_ttft_ms"] = stats.added(fig["ttft_ms"], clients[ref]["ttft_ms"])
    return out


def cancel_figures(records: list[dict[str, Any]], seen_us: dict[str, float]) -> dict[str, Any]:
    """Cancel → engine latency (ms) per kind and overall, from the client's cancel times and the
    engine's first-observation times (``cancel_seen_us``). Records whose request the engine
    never saw end (cancelled before it reached the engine, or completed) are counted apart."""
    by_kind: dict[str, list[float]] = {}
    unseen: dict[str, int] = {}
    for rec in records:
        seen = seen_us.get(rec["request_id"])
        if seen is None:
            unseen[rec["kind"]] = unseen.get(rec["kind"], 0) + 1
            continue
        by_kind.setdefault(rec["kind"], []).append((seen - rec["cancel_us"]) / 1000.0)
    everything = [x for xs in by_kind.values() for x in xs]
    return {
        "cancels": len(records),
        "latency_ms": stats.summary(everything),
        "by_kind_ms": {k: stats.summary(v) for k, v in sorted(by_kind.items())},
        "not_seen_by_engine": unseen,
    }


def leaks(counters: dict[str, Any]) -> int:
    """Requests the engine still holds once the sidecar is idle (``requests_in_flight`` counts
    running, queued and leaked ones): every one of them is a leak."""
    return int(counters.get("requests_in_flight", 0))


def goals(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The benchmark's goals against the figures present (``met`` None when not measured): relay,
    per-request, burst, latency, cancel, scale, KV and drain targets, and the Dynamo fleet path."""
    out: list[dict[str, Any]] = []

    def goal(name: str, value: float | None, target: str, ok: bool | None, unit: str = "") -> None:
        if value is not None and isinstance(value, float) and math.isnan(value):
            value, ok = None, None
        out.append({"goal": name, "value": value, "unit": unit, "target": target, "met": ok})

    relay = results.get("relay")
    if relay:
        side = relay.get("sidecar", {})
        r = relay.get("ratios", {})
        tps = side.get("tokens_per_s")
        n = relay.get("config", {}).get("streams", 256)
        goal(
            f"relay tokens/s at {n} streams",
            tps,
            ">= 10,000",
            None if tps is None else tps >= 10_000,
            "tok/s",
        )
        x = r.get("throughput_vs_engineclient")
        goal("relay vs direct EngineClient", x, ">= 0.7x", None if x is None else x >= 0.7, "x")
        x = r.get("throughput_vs_grpcio")
        goal("relay vs direct grpcio client", x, ">= 0.95x", None if x is None else x >= 0.95, "x")
        x = r.get("sidecar_cpu_per_token_vs_grpcio")
        goal("sidecar CPU/token vs grpcio client", x, "<= 1.1x", None if x is None else x <= 1.1, "x")
    for n, fig in ((results.get("openai") or {}).get("simulated") or {}).items():
        x = fig.get("added_ttft_p50_ms")
        goal(f"OpenAI front added TTFT p50, {n} stream(s)", x, "<= 2 ms", None if x is None else x <= 2, "ms")
        x = fig.get("tokens_per_s_ratio")
        goal(
            f"OpenAI front tokens/s vs EngineClient, {n} stream(s)",
            x,
            ">= 0.95x",
            None if x is None else x >= 0.95,
            "x",
        )
    short = results.get("short")
    if short and "sidecar" in short:
        x = short["sidecar"]["requests_per_s"]
        goal("short requests/s", x, ">= 1,000", x >= 1000, "req/s")
        x = short.get("ratio_vs_engineclient")
        goal("short requests vs direct EngineClient", x, ">= 0.8x", None if x is None else x >= 0.8, "x")
        x = short.get("cpu_per_request_vs_grpcio")
        goal("sidecar CPU/short request vs grpcio", x, "<= 1.3x", None if x is None else x <= 1.3, "x")
    burst = results.get("burst")
    fig64 = (burst or {}).get("sizes", {}).get("64", {}).get("clients", {}).get("json")
    if fig64 and "added_ttft_ms" in fig64:
        a = fig64["added_ttft_ms"]
        goal("burst of 64 (JSON client): added TTFT p50", a["p50"], "<= 15 ms", a["p50"] <= 15, "ms")
        goal("burst of 64 (JSON client): added TTFT p99", a["p99"], "<= 40 ms", a["p99"] <= 40, "ms")
    dyn = results.get("dynamo")
    r = (dyn or {}).get("ratios", {})
    if r:
        x = r.get("tokens_per_s_vs_anchor")
        goal("Dynamo: output tok/s vs anchor worker", x, ">= 1.2x", None if x is None else x >= 1.2, "x")
        x = r.get("ttft_p50_minus_anchor_ms")
        goal("Dynamo: TTFT p50 minus anchor's", x, "<= +5 ms", None if x is None else x <= 5, "ms")
        x = (dyn or {}).get("paced", {}).get("ratios", {}).get("ttft_p50_minus_anchor_ms")
        if x is not None:
            goal("Dynamo at equal request rate: TTFT p50 minus anchor's", x, "<= 0 ms", x <= 0, "ms")
        x = r.get("worker_cpu_per_token_vs_anchor")
        goal("Dynamo: worker CPU/token vs anchor", x, "<= 1.2x", None if x is None else x <= 1.2, "x")
    lat = results.get("latency")
    if lat and "added" in lat:
        a = lat["added"]
        for key, label, p50, p99 in (("ttft_ms", "added TTFT", 2, 10), ("itl_ms", "added ITL", 1, 5)):
            v50, v99 = a[key]["p50"], a[key]["p99"]
            goal(f"{label} p50", v50, f"<= {p50} ms", v50 <= p50, "ms")
            goal(f"{label} p99", v99, f"<= {p99} ms", v99 <= p99, "ms")
    cancel = results.get("cancel")
    if cancel and "sidecar" in cancel:
        c = cancel["sidecar"]
        v = c["latency_ms"]["p99"]
        goal("cancel → engine p99", v, "<= 20 ms", v <= 20, "ms")
        goal("leaked requests after the storm", c["leaked"], "0", c["leaked"] == 0)
    scale = results.get("scale")
    if scale:
        biggest = max(scale["points"], key=lambda p: p["streams"]) if scale.get("points") else None
        if biggest:
            v = biggest["rss_kib_per_stream"]
            goal(f"RSS per idle stream at {biggest['streams']:,}", v, "<= 32 KiB", v <= 32, "KiB")
    kv = results.get("kv")
    if kv and "blast" in kv:
        v = kv["blast"]["events_per_bridge_cpu_s"]
        goal("KV bridge events per bridge CPU-second", v, ">= 100,000", v >= 100_000, "ev/s")
        v = kv["paced"]["bridge_events_per_s"]
        target = kv["paced"]["target_events_per_s"]
        goal(
            f"KV bridge keeps up at {target:,} ev/s",
            v,
            f">= {0.95 * target:,.0f}",
            v >= 0.95 * target,
            "ev/s",
        )
    drain = results.get("drain")
    if drain and "exit_s" in drain:
        v, grace = drain["exit_s"], drain["grace_s"]
        goal("drain: SIGTERM → exit", v, f"<= grace + 1 s ({grace + 1:g} s)", v <= grace + 1, "s")
    return out
