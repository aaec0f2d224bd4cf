"""Scenario ``openai``: what the sidecar's OpenAI front adds to streamed completions.

Simulated engine: a paced engine of its own (``openai_token_delay_ms`` per token, as a real
engine decodes) with a sidecar in front (``--openai-listen``); at each concurrency (1 and 64
clients in a closed loop, staggered over one request's duration), rounds alternate the
front's client (``openai_load.through_front``: streamed ``/v1/completions``) and
``EngineClient`` on the same engine. Reported per concurrency: TTFT and
inter-token percentiles, tokens/s, what the front adds to TTFT (each round's front minus its
direct neighbour, median over rounds) and the tokens/s ratio.

vLLM (when the ``vllm`` extra is installed): the tiny model behind ``vllm-engine`` with the
sidecar's front, then stock ``vllm serve`` on the same model, each measured by the same client;
one after the other (two vLLM engines at once would share the cores), so its ratios carry more
noise than the simulated ones.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio

from sidecar.bench import procs, stats
from sidecar.bench.scenarios import Bench
from sidecar.childproc import OPENAI_READY

CONCURRENCY = (1, 64)


def _merge(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "tokens_per_s": stats.median([r["tokens_per_s"] for r in runs]),
        "ttft_ms": {p: stats.median([r["ttft_ms"][p] for r in runs]) for p in ("p50", "p99")},
        "itl_ms": {p: stats.median([r["itl_ms"][p] for r in runs]) for p in ("p50", "p99")},
        "short_streams": sum(r["short_streams"] for r in runs),
        "cpu_s": {k: sum(r["cpu_s"].get(k, 0.0) for r in runs) for k in runs[0]["cpu_s"]},
        "tokens": sum(r["tokens"] for r in runs),
    }


def _compare(front: list[dict[str, Any]], ref: list[dict[str, Any]]) -> dict[str, Any]:
    f, r = _merge(front), _merge(ref)
    added = stats.median([a["ttft_ms"]["p50"] - b["ttft_ms"]["p50"] for a, b in zip(front, ref, strict=True)])
    ratio = f["tokens_per_s"] / r["tokens_per_s"] if r["tokens_per_s"] else math.nan
    return {"front": f, "reference": r, "added_ttft_p50_ms": added, "tokens_per_s_ratio": ratio}


async def openai(b: Bench) -> dict[str, Any]:
    c = b.config
    out: dict[str, Any] = {
        "config": {
            "tokens": c.openai_tokens,
            "requests_per_client": c.openai_requests,
            "rounds": c.openai_rounds,
            "token_delay_ms": c.openai_token_delay_ms,
        },
        "simulated": {},
    }
    opts = procs.EngineOptions(model=b.model, token_delay_ms=c.openai_token_delay_ms)
    engine_dir = b.tmp / "openai-engine"
    engine_dir.mkdir(exist_ok=True)
    async with procs.engine(engine_dir, opts) as (eng, address):
        async with procs.sidecar(
            address, "--no-kv-events", "--openai-listen", "127.0.0.1:0", command=c.sidecar_command
        ) as sc:
            url = (await sc.proc.wait_for_line(OPENAI_READY)).group(1)
            pids = {"sidecar": sc.proc.pid, "engine": eng.pid}
            for n in CONCURRENCY:
                runs: dict[str, list[dict[str, Any]]] = {"front": [], "direct": []}
                for _ in range(c.openai_rounds):
                    for kind, mode in (("front", "openai-front"), ("direct", "openai-engineclient")):
                        spec = b.spec(
                            mode,
                            streams=n,
                            tokens=c.openai_tokens,
                            requests=c.openai_requests,
                            ramp_s=c.openai_tokens * c.openai_token_delay_ms / 1000,
                        )
                        spec.update(url=url, engine=address, model=b.model, pids=pids)
                        runs[kind].append(await procs.run_worker(spec))
                fig = _compare(runs["front"], runs["direct"])
                out["simulated"][str(n)] = fig
                _say(b, f"simulated c={n}", fig, "EngineClient")
    if c.openai_vllm:
        from sidecar.bench.vllm_bench import available

        if available():
            out["vllm"] = await _vllm(b)
        else:
            out["vllm"] = {"skipped": "the 'vllm' extra is not installed"}
    return out


def _say(b: Bench, label: str, fig: dict[str, Any], ref: str) -> None:
    f, r = fig["front"], fig["reference"]
    b.say(
        f"  openai {label}: front {f['tokens_per_s']:,.0f} tok/s TTFT p50 {f['ttft_ms']['p50']:.2f} ms; "
        f"{ref} {r['tokens_per_s']:,.0f} tok/s TTFT p50 {r['ttft_ms']['p50']:.2f} ms; "
        f"added TTFT p50 {fig['added_ttft_p50_ms']:+.2f} ms, tokens/s {fig['tokens_per_s_ratio']:.3f}x"
    )


# --- vLLM: the sidecar's front before vllm-engine vs vllm serve -------------------------------------


@asynccontextmanager
async def _vllm_serve(tmp: Path, model: Path) -> AsyncIterator[tuple[str, int]]:
    """Stock ``vllm serve`` (its API server module) on ``model``; yields its OpenAI base URL
    and its process id."""
    import socket

    import httpx

    from sidecar.bench.vllm_bench import ENV
    from sidecar.engines.vllm.config import DEFAULT_ENV, VllmSettings, serve_argv

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # vllm-engine's settings (sidecar.bench.vllm_bench.vllm_engine, and its own defaults)
    settings = VllmSettings(
        model=str(model), served_model_names=("tiny-llama",), dtype="float32", block_size=32
    )
    argv = serve_argv(settings, sys.executable, port)
    env = {**DEFAULT_ENV, **ENV, "VLLM_CPU_KVCACHE_SPACE": str(settings.kv_cache_gib)}
    url = f"http://127.0.0.1:{port}/v1"
    async with procs.spawn("vllm-serve", argv, env) as proc:
        deadline = time.monotonic() + 600
        async with httpx.AsyncClient() as http:
            while True:  # its readiness is its models endpoint answering (no line of ours to wait for)
                try:
                    if (await http.get(url + "/models", timeout=2)).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise procs.BenchError("vllm serve did not start in 600 s")
                await trio.sleep(0.5)
        yield url, proc.pid


async def _measure(b: Bench, url: str, pids: dict[str, int]) -> dict[str, list[dict[str, Any]]]:
    c = b.config
    out: dict[str, list[dict[str, Any]]] = {}
    for n in CONCURRENCY:
        out[str(n)] = []
        for _ in range(c.openai_rounds):
            spec = b.spec("openai-front", streams=n, tokens=c.openai_vllm_tokens, requests=2, ramp_s=1.0)
            spec.update(url=url, model="tiny-llama", pids=pids)
            out[str(n)].append(await procs.run_worker(spec, timeout=900))
    return out


async def _vllm(b: Bench) -> dict[str, Any]:
    from sidecar.bench.vllm_bench import descendants, vllm_engine

    tmp = b.tmp / "openai-vllm"
    tmp.mkdir(exist_ok=True)
    async with vllm_engine(tmp) as (eng, address):
        async with procs.sidecar(
            address, "--no-kv-events", "--openai-listen", "127.0.0.1:0", command=b.config.sidecar_command
        ) as sc:
            url = (await sc.proc.wait_for_line(OPENAI_READY)).group(1)
            pids = {"sidecar": sc.proc.pid, "vllm": eng.pid}
            pids.update({f"vllm-child{i}": p for i, p in enumerate(descendants(eng.pid))})
            ours = await _measure(b, url, pids)
    async with _vllm_serve(tmp, tmp / "tiny-llama") as (url, pid):
        pids = {"vllm": pid}
        pids.update({f"vllm-child{i}": p for i, p in enumerate(descendants(pid))})
        theirs = await _measure(b, url, pids)
    out: dict[str, Any] = {
        "config": {"tokens": b.config.openai_vllm_tokens, "rounds": b.config.openai_rounds}
    }
    for n in map(str, CONCURRENCY):
        fig = _compare(ours[n], theirs[n])
        # CPU per token of every server process on each path (the sidecar, vllm-engine and
        # vLLM's engine processes; vllm serve and its engine processes): on a CPU machine both
        # paths share the cores the model runs on
        for side in ("front", "reference"):
            f = fig[side]
            servers = sum(v for k, v in f["cpu_s"].items() if k != "self")
            f["server_cpu_us_per_token"] = servers / f["tokens"] * 1e6 if f["tokens"] else float("nan")
        out[n] = fig
        _say(b, f"vLLM c={n}", fig, "vllm serve")
        b.say(
            f"    server CPU per token: front path {fig['front']['server_cpu_us_per_token']:,.0f} µs "
            f"(sidecar {fig['front']['cpu_s'].get('sidecar', 0.0):.2f} s), vllm serve "
            f"{fig['reference']['server_cpu_us_per_token']:,.0f} µs"
        )
    return out
