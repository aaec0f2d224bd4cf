"""Scenario ``vllm``: what the sidecar adds in front of real vLLM (needs the ``vllm`` extra).

Builds the tiny model (``sidecar.engines.vllm.tiny_model``) in the run's directory, starts
``vllm-engine`` on it and a sidecar in front, then runs rounds of greedy streams through the
sidecar and, **at the same time**, as many directly with ``EngineClient`` (``vllm_load``):
vLLM batches both halves together, so each step's tokens leave the engine for both at once and
the machine's noise is the same for both. Reported: TTFT and inter-token gap percentiles of
each (medians over rounds) and what the sidecar adds (each round's sidecar minus direct, then
the median over rounds: the halves are paired), tokens/s, the CPU
per token of each client and of the sidecar, and vLLM's (its three processes, over all tokens).
The engine start (tens of seconds) is not measured.
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
from sidecar.nursery import first_leaf

MODEL = "tiny-llama"
START_TIMEOUT = 600.0
EXTRA_MISSING = "the 'vllm' extra is not installed (run scripts/install-vllm)"
#: vLLM's environment in the bench, for ``vllm-engine`` and ``vllm serve`` alike: the model's
#: OpenMP thread on core 0 (vLLM's own choice on two cores is one thread too, on a core it picks).
ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0"}


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
            [sys.executable, "-m", "sidecar.engines.vllm.tiny_model", str(model)],
            capture_stdout=True,
            capture_stderr=True,
        )
    argv = [sys.executable, "-m", "sidecar", "vllm-engine", "--model", str(model), "--dtype", "float32"]
    argv += ["--block-size", "32", "--served-model-name", MODEL, "--listen", f"unix://{tmp}/vllm.sock"]
    async with procs.spawn("vllm-engine", argv, ENV) as proc:
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
    """The scenario; a failure is one :class:`~sidecar.bench.procs.BenchError` (not a group: the
    engine and the sidecar run in nurseries), so the run records it and goes on."""
    if not available():
        raise procs.BenchError(EXTRA_MISSING)
    try:
        return await _vllm(b)
    except BaseExceptionGroup as group:
        failed, rest = group.split(procs.BenchError)
        if failed is None or rest is not None:
            raise
        raise first_leaf(failed) from None


async def _round(
    b: Bench, sc: procs.SidecarProcess, address: str, pids: dict[str, int], r: int
) -> dict[str, Any]:
    """One round: the sidecar half and the direct half at once (vLLM batches them together)."""
    c = b.config
    common = {"streams": c.vllm_streams, "tokens": c.vllm_tokens, "prompt_tokens": c.vllm_prompt_tokens}
    res: dict[str, Any] = {}
    armed: list[str] = []
    both = trio.Event()

    async def on_armed(kind: str) -> None:
        armed.append(kind)
        if len(armed) == 2:
            both.set()
        with trio.move_on_after(120):
            await both.wait()
        if not both.is_set():
            raise procs.BenchError(f"vllm round {r}: the other half never connected")

    async def one(kind: str) -> None:
        spec = b.spec(f"vllm-{kind}", sidecar=sc, **common, seed=r * 2 + (kind == "direct"))
        spec.update(engine=address, model=MODEL, pids=pids)
        res[kind] = await procs.run_worker(spec, on_armed=lambda _info: on_armed(kind))

    async with trio.open_nursery() as nursery:
        for kind in ("sidecar", "direct"):
            nursery.start_soon(one, kind)
    return res


async def _vllm(b: Bench) -> dict[str, Any]:
    c = b.config
    rounds: dict[str, list[dict[str, Any]]] = {"sidecar": [], "direct": []}
    async with vllm_engine(b.tmp) as (eng, address):
        b.say(f"  vllm-engine (pid {eng.pid}) on {address}")
        async with procs.sidecar(address, command=c.sidecar_command) as sc:
            pids = {"sidecar": sc.proc.pid, "vllm": eng.pid}
            pids.update({f"vllm-child{i}": p for i, p in enumerate(descendants(eng.pid))})
            for r in range(c.vllm_rounds + 1):  # round 0 warms both paths up, uncounted
                res = await _round(b, sc, address, pids, r)
                if r == 0:
                    continue
                for kind in ("sidecar", "direct"):
                    rounds[kind].append(res[kind])
                    x = res[kind]
                    b.say(
                        f"  vllm round {r}/{c.vllm_rounds} {kind:<8} {x['tokens_per_s']:>7,.0f} tok/s  "
                        f"TTFT p50 {x['ttft_ms']['p50']:.1f} ms  ITL p50 {x['itl_ms']['p50']:.2f} "
                        f"p99 {x['itl_ms']['p99']:.2f} ms"
                    )
    config = {"streams": c.vllm_streams, "tokens": c.vllm_tokens, "prompt_tokens": c.vllm_prompt_tokens}
    out: dict[str, Any] = {
        "config": {**config, "rounds": c.vllm_rounds, "model": "tiny random Llama, float32"}
    }
    out.update({kind: _merge(runs) for kind, runs in rounds.items()})
    s, d = out["sidecar"], out["direct"]
    # paired: each round's difference (both halves ran together), then the median over rounds
    out["added"] = {
        key: {
            p: stats.median(
                [x[key][p] - y[key][p] for x, y in zip(rounds["sidecar"], rounds["direct"], strict=True)]
            )
            for p in ("p50", "p90", "p99", "mean")
        }
        for key in ("ttft_ms", "itl_ms")
    }
    # vLLM served both halves in the same windows: its CPU over all their tokens
    vllm_cpu = sum(v for run in rounds["sidecar"] for k, v in run["cpu_s"].items() if k.startswith("vllm"))
    both = s["tokens"] + d["tokens"]
    out["vllm_cpu_us_per_token"] = vllm_cpu / both * 1e6 if both else math.nan
    out["runs"] = rounds
    a = out["added"]
    b.say(
        f"  vllm: the sidecar adds TTFT p50 {a['ttft_ms']['p50']:+.2f} p99 {a['ttft_ms']['p99']:+.2f} ms, "
        f"ITL p50 {a['itl_ms']['p50']:+.2f} p99 {a['itl_ms']['p99']:+.2f} ms; sidecar CPU "
        f"{s['cpu_us_per_token']['sidecar']:.0f} µs/token (vLLM {out['vllm_cpu_us_per_token']:,.0f})"
    )
    return out
