"""The results table and the goals table (plain text, also pasted into docs/PERFORMANCE.md)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from sidecar.bench.stats import fmt


def _ms(x: float | None, signed: bool = False) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:+.2f}" if signed else f"{x:.2f}"


def _times(x: float | None, suffix: str = "") -> str:
    """A ratio (``-`` when not measured: NaN in memory, ``null`` once written as JSON)."""
    return f"{fmt(x, 2)}x{suffix}" if fmt(x) != "-" else "-"


def _vllm_rows(v: dict[str, Any] | None) -> list[tuple[str, str, str, str, str]]:
    """The ``vllm`` scenario: real vLLM through the sidecar vs the direct EngineClient."""
    if not v or "added" not in v:
        return []
    s, d, a, cfg = v["sidecar"], v["direct"], v["added"], v["config"]
    out = [
        (
            f"vLLM tokens/s ({cfg['streams']} + {cfg['streams']} x {cfg['tokens']} greedy at once, {cfg['rounds']} rounds)",
            fmt(s["tokens_per_s"]),
            fmt(d["tokens_per_s"]),
            "",
            _times(s["tokens_per_s"] / d["tokens_per_s"] if d["tokens_per_s"] else None),
        )
    ]
    for key, label in (("ttft_ms", "vLLM TTFT"), ("itl_ms", "vLLM inter-token gap")):
        out.append(
            (
                f"{label} p50 | p99 ms",
                f"{_ms(s[key]['p50'])} | {_ms(s[key]['p99'])}",
                f"{_ms(d[key]['p50'])} | {_ms(d[key]['p99'])}",
                "",
                f"{_ms(a[key]['p50'], True)} | {_ms(a[key]['p99'], True)} added",
            )
        )
    cpu_s, cpu_d = s["cpu_us_per_token"], d["cpu_us_per_token"]
    out.append(
        (
            "vLLM CPU µs per token: sidecar | client | vLLM",
            f"{fmt(cpu_s.get('sidecar'), 1)} | {fmt(cpu_s.get('self'), 1)} | {fmt(v.get('vllm_cpu_us_per_token'), 0)}",
            f"- | {fmt(cpu_d.get('self'), 1)} | (same)",
            "",
            "",
        )
    )
    return out


def openai_rows(results: dict[str, Any]) -> list[tuple[str, str, str, str, str]]:
    """The ``openai`` scenario: the OpenAI front vs EngineClient (simulated) and vs vllm serve."""
    o = results.get("openai")
    if not o:
        return []
    out = []
    for part, ref in (("simulated", "EngineClient"), ("vllm", "vllm serve")):
        for n, fig in (o.get(part) or {}).items():
            if not isinstance(fig, dict) or "front" not in fig:
                continue
            f, r = fig["front"], fig["reference"]
            out.append(
                (
                    f"{'simulated engine' if part == 'simulated' else 'vLLM'}, {n} stream{'s' if n != '1' else ''} (vs {ref})",
                    f"{fmt(f['tokens_per_s'])} | {fmt(r['tokens_per_s'])}",
                    f"{_ms(f['ttft_ms']['p50'])} | {_ms(r['ttft_ms']['p50'])}",
                    _ms(fig["added_ttft_p50_ms"], True),
                    _times(fig["tokens_per_s_ratio"]),
                )
            )
    return out


def rows(results: dict[str, Any]) -> list[tuple[str, str, str, str, str]]:
    """(metric, through the sidecar, direct EngineClient, grpcio + protobuf, sidecar vs direct)."""
    out: list[tuple[str, str, str, str, str]] = []
    relay = results.get("relay")
    if relay:
        cfg = relay["config"]
        s, e, g = relay.get("sidecar", {}), relay.get("engineclient", {}), relay.get("grpcio", {})
        r = relay.get("ratios", {})
        out.append(
            (
                f"relay tokens/s ({cfg['streams']} x {cfg['tokens']}, median of {cfg['rounds']})",
                fmt(s.get("tokens_per_s", math.nan)),
                fmt(e.get("tokens_per_s", math.nan)),
                fmt(g.get("tokens_per_s", math.nan)),
                _times(r.get("throughput_vs_engineclient")),
            )
        )
        out.append(
            (
                "CPU µs per token: sidecar process | client",
                fmt(s.get("sidecar_cpu_us_per_token", math.nan), 1),
                fmt(e.get("client_cpu_us_per_token", math.nan), 1),
                fmt(g.get("client_cpu_us_per_token", math.nan), 1),
                _times(r.get("sidecar_cpu_per_token_vs_grpcio"), " grpcio"),
            )
        )
        out.append(
            (
                "CPU µs per token: load generator | engine",
                f"{fmt(s.get('client_cpu_us_per_token', math.nan), 1)} | "
                f"{fmt(s.get('engine_cpu_us_per_token', math.nan), 1)}",
                f"- | {fmt(e.get('engine_cpu_us_per_token', math.nan), 1)}",
                f"- | {fmt(g.get('engine_cpu_us_per_token', math.nan), 1)}",
                "",
            )
        )
    short = results.get("short")
    if short and "sidecar" in short:
        s, e, g = short["sidecar"], short.get("engineclient", {}), short.get("grpcio", {})
        out.append(
            (
                f"short requests/s (1 token, {short['config']['concurrency']} clients)",
                fmt(s["requests_per_s"]),
                fmt(e.get("requests_per_s", math.nan)),
                fmt(g.get("requests_per_s", math.nan)),
                _times(short.get("ratio_vs_engineclient")),
            )
        )
        out.append(
            (
                "CPU µs per short request: sidecar process | client",
                fmt(s.get("cpu_us_per_request", math.nan)),
                fmt(e.get("cpu_us_per_request", math.nan)),
                fmt(g.get("cpu_us_per_request", math.nan)),
                _times(short.get("cpu_per_request_vs_grpcio"), " grpcio"),
            )
        )
    lat = results.get("latency")
    if lat and "added" in lat:
        s, e, a = lat["sidecar"], lat["engineclient"], lat["added"]
        for key, label in (
            ("ttft_ms", "TTFT"),
            ("itl_ms", "inter-token gap"),
            ("oneway_ms", "engine → client"),
        ):
            out.append(
                (
                    f"{label} p50 | p99 ms ({lat['config']['streams']} streams x {lat['config']['tokens_per_s_per_stream']:g} tok/s)",
                    f"{_ms(s[key]['p50'])} | {_ms(s[key]['p99'])}",
                    f"{_ms(e[key]['p50'])} | {_ms(e[key]['p99'])}",
                    "",
                    f"{_ms(a[key]['p50'], True)} | {_ms(a[key]['p99'], True)} added",
                )
            )
    out.extend(_vllm_rows(results.get("vllm")))
    cancel = results.get("cancel")
    if cancel and "sidecar" in cancel:
        s, e = cancel["sidecar"], cancel.get("engineclient")
        out.append(
            (
                f"cancel → engine p50 | p99 ms ({s['streams']} streams)",
                f"{_ms(s['latency_ms']['p50'])} | {_ms(s['latency_ms']['p99'])}",
                f"{_ms(e['latency_ms']['p50'])} | {_ms(e['latency_ms']['p99'])}" if e else "",
                "",
                "",
            )
        )
        out.append(
            ("leaked requests after the storm", str(s["leaked"]), str(e["leaked"]) if e else "", "", "")
        )
    scale = results.get("scale")
    for p in scale.get("points", []) if scale else []:
        out.append(
            (f"RSS KiB per idle stream at {p['streams']:,}", fmt(p["rss_kib_per_stream"], 1), "", "", "")
        )
    kv = results.get("kv")
    if kv and "blast" in kv:
        out.append(
            (
                "KV bridge events per bridge CPU-second",
                fmt(kv["blast"]["events_per_bridge_cpu_s"]),
                "",
                "",
                "",
            )
        )
        p = kv["paced"]
        out.append(
            (
                f"KV bridge added latency p50 | p99 ms at {p['target_events_per_s']:,} ev/s",
                f"{_ms(p['added_latency_ms']['p50'])} | {_ms(p['added_latency_ms']['p99'])}",
                "",
                "",
                "",
            )
        )
    drain = results.get("drain")
    if drain and "exit_s" in drain:
        out.append(
            (
                f"drain: SIGTERM → exit s ({drain['streams']} streams, grace {drain['grace_s']:g} s)",
                _ms(drain["exit_s"]),
                "",
                "",
                "",
            )
        )
    return out


def _table(header: Sequence[str], body: Sequence[Sequence[str]]) -> str:
    """A Markdown table, columns padded; ``|`` and line breaks in a cell are escaped so that
    every row keeps its columns."""

    def cell(text: str) -> str:
        return " ".join(str(text).split()).replace("|", "\\|")

    cells = [tuple(cell(c) for c in row) for row in [header, *body]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def burst_rows(results: dict[str, Any]) -> list[tuple[str, str, str, str, str]]:
    """(streams at once, client, TTFT p50 / p99 ms, added p50 / p99 ms, sidecar CPU µs/request)."""
    burst = results.get("burst")
    out: list[tuple[str, str, str, str, str]] = []
    for size, fig in (burst or {}).get("sizes", {}).items():
        ref = fig.get("reference", "")
        for kind, f in fig["clients"].items():
            t, a = f["ttft_ms"], f.get("added_ttft_ms")
            out.append(
                (
                    size,
                    kind + (" (reference)" if kind == ref else ""),
                    f"{_ms(t['p50'])} / {_ms(t['p99'])}",
                    f"{_ms(a['p50'], True)} / {_ms(a['p99'], True)}" if a else "",
                    fmt(f.get("sidecar_cpu_us_per_request"), 0) if "sidecar_cpu_us_per_request" in f else "",
                )
            )
    return out


def fleet_rows(results: dict[str, Any]) -> list[tuple[str, str, str, str, str]]:
    """(metric, run --dynamo, anchor worker, dynamo.mocker, sidecar vs anchor)."""
    dyn = results.get("dynamo")
    if not dyn or "skipped" in dyn:
        return []
    s, a, m = dyn.get("sidecar", {}), dyn.get("anchor", {}), dyn.get("mocker", {})
    r = dyn.get("ratios", {})

    def row(label: str, key: str, digits: int, vs: str) -> tuple[str, str, str, str, str]:
        return (
            label,
            fmt(s.get(key, math.nan), digits),
            fmt(a.get(key, math.nan), digits),
            fmt(m.get(key, math.nan), digits),
            vs,
        )

    cfg = dyn["config"]
    gap = r.get("ttft_p50_minus_anchor_ms")
    return [
        row(
            f"output tokens/s ({cfg['requests']} x {cfg['tokens']}, concurrency {cfg['concurrency']})",
            "tokens_per_s",
            0,
            _times(r.get("tokens_per_s_vs_anchor")),
        ),
        row("requests/s", "requests_per_s", 1, ""),
        row("TTFT p50 ms", "ttft_p50_ms", 1, "" if gap is None else f"{gap:+.1f} ms"),
        row("TTFT p90 ms", "ttft_p90_ms", 1, ""),
        row(
            "worker CPU µs per output token",
            "worker_cpu_us_per_token",
            1,
            _times(r.get("worker_cpu_per_token_vs_anchor")),
        ),
        row(
            "worker CPU µs per request",
            "worker_cpu_us_per_request",
            0,
            _times(r.get("worker_cpu_per_request_vs_anchor")),
        ),
        row("frontend CPU µs per request", "frontend_cpu_us_per_request", 0, ""),
        *_paced_rows(dyn.get("paced")),
    ]


def _paced_rows(paced: dict[str, Any] | None) -> list[tuple[str, str, str, str, str]]:
    """The fleet table's rows for the paced rounds (the same open-loop rate for both workers)."""
    if not paced or "sidecar" not in paced or "anchor" not in paced:
        return []
    s, a = paced["sidecar"], paced["anchor"]
    gap = paced.get("ratios", {}).get("ttft_p50_minus_anchor_ms")
    label = f"at an equal {paced['rate']:,.1f} req/s (open loop): TTFT p50"
    return [
        (
            label + " ms",
            fmt(s["ttft_p50_ms"], 1),
            fmt(a["ttft_p50_ms"], 1),
            "-",
            "" if gap is None else f"{gap:+.1f} ms",
        ),
        ("  same: TTFT p90 ms", fmt(s["ttft_p90_ms"], 1), fmt(a["ttft_p90_ms"], 1), "-", ""),
        (
            "  same: worker CPU µs per request",
            fmt(s["worker_cpu_us_per_request"], 0),
            fmt(a["worker_cpu_us_per_request"], 0),
            "-",
            _times(paced.get("ratios", {}).get("worker_cpu_per_request_vs_anchor")),
        ),
    ]


def render_table(results: dict[str, Any]) -> str:
    parts = []
    body = rows(results)
    if body:
        parts.append(
            _table(("metric", "via sidecar", "EngineClient", "grpcio+upb", "sidecar vs direct"), body)
        )
    burst = burst_rows(results)
    if burst:
        parts.append(
            _table(
                (
                    "burst: streams at once",
                    "client",
                    "TTFT p50 / p99 ms",
                    "added p50 / p99 ms",
                    "sidecar CPU µs/request",
                ),
                burst,
            )
        )
    fleet = fleet_rows(results)
    if fleet:
        header = (
            "Dynamo fleet path",
            "run --dynamo",
            "anchor worker",
            "dynamo.mocker (ceiling)",
            "sidecar vs anchor",
        )
        parts.append(_table(header, fleet))
    oa = openai_rows(results)
    if oa:
        header = (
            "OpenAI front (streamed)",
            "tokens/s: front | ref",
            "TTFT p50 ms: front | ref",
            "added TTFT p50 ms",
            "tokens/s ratio",
        )
        parts.append(_table(header, oa))
    dyn = results.get("dynamo")
    if dyn and "skipped" in dyn:
        parts.append(f"dynamo: skipped ({dyn['skipped']})")
    return "\n\n".join(parts) if parts else "(no results)"


def render_goals(goals: list[dict[str, Any]]) -> str:
    if not goals:
        return "(no goals measured)"
    header = ("goal", "value", "target", "met")
    body = []
    for g in goals:
        v = g["value"]
        value = "-" if v is None else (f"{v:,.2f}" if isinstance(v, float) and abs(v) < 100 else f"{v:,.0f}")
        if g["unit"] and v is not None:
            value += f" {g['unit']}"
        met = {True: "yes", False: "NO", None: "-"}[g["met"]]
        body.append((g["goal"], value, g["target"], met))
    return _table(header, body)
