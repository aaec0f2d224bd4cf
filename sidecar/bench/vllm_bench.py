"""Scenario ``vllm``: what the sidecar adds in front of real vLLM (needs the ``vllm`` extra).

Builds the tiny model (``sidecar.engines.vllm.tiny_model``) in the run's directory, starts
``vllm-engine`` on it and a sidecar in front, then alternates rounds of the same greedy streams
through the sidecar and directly with ``EngineClient`` (``vllm_load``), so both see the same
engine and the same machine noise. Reported: TTFT and inter-token gap percentiles of each and
what the sidecar adds (sidecar minus direct), tokens/s, and CPU per token of the client, the
sidecar and vLLM's three processes. The engine start (tens of seconds) is not measured.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio

from sidecar.bench import procs, stats
from sidecar.bench.scenarios import Bench
from sidecar.childproc import ENGINE_READY, ChildLineTimeout

MODEL = "tiny-llama"
START_TIMEOUT = 600.0
EXTRA_MISSING = "the 'vllm' extra is not installed (run scripts/install-vllm)"


def available() -> bool:
    """Whether the ``vllm`` extra is installed (the scenario is then part of the default run)."""
    return importlib.util.find_spec("vllm") is not None


def descendants(pid: int) -> list[int]:
    """Child processes of ``pid``, recursively (vLLM's engine core and worker)."""
    out: list[int] = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return out
    for task in tasks:
        try:
            children = [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
        for child in children:
            out += [child, *descendants(child)]
    return out


@asynccontextmanager
async def vllm_engine(tmp: Path) -> AsyncIterator[tuple[procs.Proc, str]]:
    """The tiny model and ``vllm-engine`` on a Unix socket; yields (proc, address)."""
    model = tmp / "tiny-llama"
    with trio.fail_after(300):
        await trio.run_process(
            [sys.executable, "-m", "sidecar.engines.vllm.tiny_model", str(model)], capture_stdout=True
        )
    argv = [sys.executable, "-m", "sidecar", "vllm-engine", "--model", str(model), "--dtype", "float32"]
    argv += ["--block-size", "32", "--served-model-name", MODEL, "--listen", f"unix://{tmp}/vllm.sock"]
    async with procs.spawn("vllm-engine", argv) as proc:
        try:
            m = await proc.wait_for_line(ENGINE_READY, timeout=START_TIMEOUT)
        except ChildLineTimeout as err:
            raise procs.BenchError(str(err)) from None
        yield proc, m.group(1)


def _merge(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The rounds of one kind, summed; percentiles of the per-round medians and tails."""
    tokens = sum(r["tokens"] for r in runs)
    seconds = sum(r["seconds"] for r in runs)
    cpu = {k: sum(r["cpu_s"][k] for r in runs) for k in runs[0]["cpu_s"]}
    out: dict[str, Any] = {
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds if seconds else math.nan,
        "cpu_us_per_token": {k: v / tokens * 1e6 if tokens else math.nan for k, v in cpu.items()},
    }
    for key in ("ttft_ms", "itl_ms"):
        out[key] = {p: stats.median([r[key][p] for r in runs]) for p in ("p50", "p90", "p99", "mean")}
    return out


async def vllm(b: Bench) -> dict[str, Any]:
    if not available():
        raise procs.BenchError(EXTRA_MISSING)
    c = b.config
    common = {"streams": c.vllm_streams, "tokens": c.vllm_tokens, "prompt_tokens": c.vllm_prompt_tokens}
    rounds: dict[str, list[dict[str, Any]]] = {"sidecar": [], "direct": []}
    async with vllm_engine(b.tmp) as (eng, address):
        b.say(f"  vllm-engine (pid {eng.pid}) on {address}")
        async with procs.sidecar(address, command=c.sidecar_command) as sc:
            pids = {"sidecar": sc.proc.pid, "vllm": eng.pid}
            pids.update({f"vllm-child{i}": p for i, p in enumerate(descendants(eng.pid))})
            for r in range(c.vllm_rounds + 1):  # round 0 warms both paths up, uncounted
                for kind in ("sidecar", "direct"):
                    spec = b.spec(f"vllm-{kind}", sidecar=sc, **common, seed=r * 2 + (kind == "direct"))
                    spec.update(engine=address, model=MODEL, pids=pids)
                    res = await procs.run_worker(spec)
                    if r == 0:
                        continue
                    rounds[kind].append(res)
                    b.say(
                        f"  vllm round {r}/{c.vllm_rounds} {kind:<8} {res['tokens_per_s']:>7,.0f} tok/s  "
                        f"TTFT p50 {res['ttft_ms']['p50']:.1f} ms  ITL p50 {res['itl_ms']['p50']:.2f} "
                        f"p99 {res['itl_ms']['p99']:.2f} ms"
                    )
    out: dict[str, Any] = {
        "config": {**common, "rounds": c.vllm_rounds, "model": "tiny random Llama, float32"}
    }
    out.update({kind: _merge(runs) for kind, runs in rounds.items()})
    s, d = out["sidecar"], out["direct"]
    out["added"] = {key: stats.added(s[key], d[key]) for key in ("ttft_ms", "itl_ms")}
    out["runs"] = rounds
    a = out["added"]
    b.say(
        f"  vllm: the sidecar adds TTFT p50 {a['ttft_ms']['p50']:+.2f} p99 {a['ttft_ms']['p99']:+.2f} ms, "
        f"ITL p50 {a['itl_ms']['p50']:+.2f} p99 {a['itl_ms']['p99']:+.2f} ms; sidecar CPU "
        f"{s['cpu_us_per_token']['sidecar']:.0f} µs/token; tokens/s {s['tokens_per_s']:,.0f} vs {d['tokens_per_s']:,.0f}"
    )
    return out
