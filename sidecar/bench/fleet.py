"""Scenario ``dynamo``: the fleet path — Dynamo's real frontend in front of three workers.

One ``python -m dynamo.frontend`` (file discovery under the run's temp dir, TCP request
plane, ZMQ event plane, loopback only) serves three models, each backed by one worker:

- ``sidecar``: ``openengine-sidecar run --dynamo`` in front of the run's engine;
- ``anchor``: :mod:`sidecar.bench.dynamo_anchor` (plain asyncio + grpcio + upb) in front of
  the **same** engine — what the sidecar's Dynamo plane is judged against;
- ``mocker``: ``python -m dynamo.mocker`` (no engine hop at all: a ceiling, not an anchor).

All three register the same mock-vocabulary tokenizer directory under their own name and
namespace, so the frontend does the same work for each and rounds alternate
sidecar / anchor / mocker without restarting anything. The load is
:mod:`sidecar.bench.fleet_load` (streamed completions, a connection per request). Figures:
output tokens/s, requests/s, TTFT p50/p90, and CPU per output token and per request of the
worker process (and of the frontend), medians over rounds.

The rounds above are a closed loop (``concurrency`` users, each sending when its last request
ended), so a worker that serves more requests per second also has more in flight per second on
the same two cores — its TTFT pays for its own throughput. The **paced** rounds after them
offer both ``sidecar`` and ``anchor`` the same open-loop request rate (:data:`PACED_SHARE` of
the slower worker's closed-loop requests/s): TTFT at equal load (``paced`` in the results).

Needs the ``dynamo`` extra (``scripts/install-dynamo``): without it the scenario reports
``skipped`` with the reason; without grpcio-tools, the anchor row is missing (said so).
"""

from __future__ import annotations

import importlib.util
import math
import re
import socket
import sys
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import trio

from sidecar.bench import analysis, fleet_load, procs, stats

KINDS = ("sidecar", "anchor", "mocker")
ANCHOR_READY = re.compile(r"anchor: serving")
_MODULES = ("dynamo.llm", "dynamo.runtime", "dynamo.frontend", "dynamo.mocker", "tokenizers")


def missing_dynamo() -> str | None:
    """Why the scenario cannot run here (``None``: it can)."""
    for name in _MODULES:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            return f"{name} is not installed (scripts/install-dynamo installs the dynamo extra)"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def planes_env(tmp: Path) -> dict[str, str]:
    """The DYN_* settings the frontend and every worker share: file discovery, tcp, zmq."""
    return {
        "DYN_DISCOVERY_BACKEND": "file",
        "DYN_FILE_KV": str(tmp / "dynamo-kv"),
        "DYN_REQUEST_PLANE": "tcp",
        "DYN_EVENT_PLANE": "zmq",
        "DYN_TCP_RPC_HOST": "127.0.0.1",
        "DYN_TCP_RESPONSE_STREAM_HOST": "127.0.0.1",
        "DYN_EVENT_PLANE_HOST": "127.0.0.1",
        "DYN_SELF_HOST_METADATA": "0",
        "DYN_LOG": "warn",
    }


async def _until(cond: Any, timeout: float, what: str, proc: procs.Proc | None = None) -> None:
    """Poll ``cond()`` (another process's state) every 0.1 s until true; BenchError after ``timeout``."""
    with trio.move_on_after(timeout):
        while True:
            if proc is not None and proc.process.returncode is not None:
                raise procs.BenchError(f"{what}: {proc.name} exited:\n{proc.tail()}")
            try:
                if await cond():
                    return
            except OSError:
                pass
            await trio.sleep(0.1)
    raise procs.BenchError(f"{what}: not within {timeout:.0f} s" + (f"; log:\n{proc.tail()}" if proc else ""))


@asynccontextmanager
async def frontend(env: dict[str, str]) -> AsyncIterator[tuple[procs.Proc, str]]:
    port = free_port()
    argv = [sys.executable, "-m", "dynamo.frontend", "--http-host", "127.0.0.1", "--http-port", str(port)]
    argv += ["--discovery-backend", "file", "--request-plane", "tcp", "--event-plane", "zmq"]
    url = f"http://127.0.0.1:{port}"
    async with procs.spawn("frontend", argv, env) as proc:

        async def up() -> bool:
            return (await fleet_load.get_json(url, "/v1/models"))[0] == 200

        await _until(up, 60, "dynamo.frontend", proc)
        yield proc, url


async def models(url: str) -> set[str]:
    status, body = await fleet_load.get_json(url, "/v1/models")
    return {m["id"] for m in body["data"]} if status == 200 and body else set()


@asynccontextmanager
async def workers(
    b: Any, env: dict[str, str], tok: Path, names: dict[str, str]
) -> AsyncIterator[dict[str, procs.Proc]]:
    """Start the workers named in ``names`` (kind -> served model name); yields kind -> process."""
    out: dict[str, procs.Proc] = {}
    async with AsyncExitStack() as stack:
        if "sidecar" in names:
            sc = await stack.enter_async_context(
                procs.sidecar(
                    b.engine_address,
                    "--no-kv-events",
                    "--dynamo",
                    "--dynamo-namespace",
                    "bench-sidecar",
                    "--dynamo-discovery-backend",
                    "file",
                    "--dynamo-request-plane",
                    "tcp",
                    "--dynamo-event-plane",
                    "zmq",
                    "--dynamo-model-path",
                    str(tok),
                    command=b.config.sidecar_command,
                    env=env,
                )
            )
            out["sidecar"] = sc.proc
        if "anchor" in names:
            argv = [sys.executable, "-m", "sidecar.bench.dynamo_anchor", "--engine", b.engine_address]
            argv += ["--pb2-dir", str(b.pb2_dir), "--model-path", str(tok), "--model-name", names["anchor"]]
            argv += ["--engine-model", b.model, "--namespace", "bench-anchor"]
            proc = await stack.enter_async_context(procs.spawn("anchor", argv, env))
            await procs.wait_ready(proc, ANCHOR_READY)
            out["anchor"] = proc
        if "mocker" in names:
            argv = [sys.executable, "-m", "dynamo.mocker", "--model-path", str(tok)]
            argv += ["--model-name", names["mocker"], "--endpoint", "dyn://bench-mocker.backend.generate"]
            argv += ["--speedup-ratio", "10000", "--max-num-seqs", "256", "--block-size", "16"]
            out["mocker"] = await stack.enter_async_context(procs.spawn("mocker", argv, env))
        yield out


async def dynamo(b: Any) -> dict[str, Any]:
    """The scenario (see the module doc)."""
    reason = missing_dynamo()
    if reason is not None:
        b.say(f"  dynamo: skipped — {reason}")
        return {"skipped": reason}
    from sidecar.dynamo.tokenizer_dir import write_mock_tokenizer_dir

    c = b.config
    tmp = b.tmp / "dynamo"
    tmp.mkdir(parents=True, exist_ok=True)
    env = planes_env(tmp)
    tok = write_mock_tokenizer_dir(tmp / "tokenizer")
    names = {"sidecar": b.model, "anchor": f"{b.model}-anchor", "mocker": f"{b.model}-mocker"}
    notes: list[str] = []
    if b.pb2_dir is None:
        del names["anchor"]
        notes.append("anchor unavailable: grpcio-tools missing (pip install -e '.[dev]')")
        b.say(f"  dynamo: {notes[-1]}")
    load = {"requests": c.dynamo_requests, "concurrency": c.dynamo_concurrency, "tokens": c.dynamo_tokens}
    rounds: dict[str, list[dict[str, Any]]] = {k: [] for k in names}
    paced: dict[str, list[dict[str, Any]]] = {"sidecar": [], "anchor": []}
    profiles: dict[str, Any] = {}
    async with frontend(env) as (fe, url), workers(b, env, tok, names) as procs_by_kind:

        async def listed() -> bool:
            return set(names.values()) <= await models(url)

        await _until(listed, 90, f"models {sorted(names.values())} listed by the frontend", fe)

        def spec_of(kind: str, **extra: Any) -> dict[str, Any]:
            pids = {"worker": procs_by_kind[kind].pid, "frontend": fe.pid, "engine": b.engine.pid}
            return {"mode": "fleet", "url": url, "model": names[kind], "pids": pids, **load, **extra}

        async def measure(kind: str, **extra: Any) -> dict[str, Any]:
            await b.settle()
            return await procs.run_worker(spec_of(kind, **extra), timeout=900)

        for r in range(c.dynamo_rounds):
            for kind in names:
                res = await measure(kind)
                rounds[kind].append(res)
                b.say(
                    f"  dynamo round {r + 1}/{c.dynamo_rounds} {kind:<8} {res['tokens_per_s']:>8,.0f} tok/s "
                    f"{res['requests_per_s']:>6,.1f} req/s  TTFT p50 {res['ttft_ms']['p50']:.1f} "
                    f"p90 {res['ttft_ms']['p90']:.1f} ms  worker "
                    f"{_us(res['cpu_s']['worker'], res['out_tokens']):.1f} µs/tok "
                    f"{_us(res['cpu_s']['worker'], res['completed']):,.0f} µs/req  errors {res['errors']}"
                )
        rate = _paced_rate(rounds)
        if rate is not None:  # the same open-loop request rate for both: TTFT at equal load
            for r in range(c.dynamo_rounds):
                for kind in ("sidecar", "anchor"):
                    res = await measure(kind, rate=rate)
                    paced[kind].append(res)
                    b.say(
                        f"  dynamo paced {r + 1}/{c.dynamo_rounds} {kind:<8} {rate:,.1f} req/s offered, "
                        f"{res['requests_per_s']:,.1f} done  TTFT p50 {res['ttft_ms']['p50']:.1f} "
                        f"p90 {res['ttft_ms']['p90']:.1f} ms  worker "
                        f"{_us(res['cpu_s']['worker'], res['completed']):,.0f} µs/req  errors {res['errors']}"
                    )
        if c.profile_dir is not None:
            from sidecar.bench.scenarios import profile_round

            for kind in ("sidecar", "anchor"):
                if kind in names:
                    spec = spec_of(kind)
                    profiles[kind] = await profile_round(b, f"{kind}-dynamo", procs_by_kind[kind].pid, spec)
    out = fleet_figures(rounds)
    if paced["sidecar"] and paced["anchor"]:
        out["paced"] = fleet_figures(paced)
        out["paced"]["rate"] = paced["sidecar"][0]["rate"]
    if profiles:
        out["profile"] = profiles
    out["config"] = {**load, "rounds": c.dynamo_rounds, "names": names}
    out["notes"] = notes
    out["runs"] = rounds
    out["paced_runs"] = paced
    return out


#: The paced rounds offer this share of the slower worker's closed-loop request rate.
PACED_SHARE = 0.8


def _paced_rate(rounds: dict[str, list[dict[str, Any]]]) -> float | None:
    """The open-loop rate both workers are measured at: :data:`PACED_SHARE` of the slower one's
    median closed-loop requests/s (None without both)."""
    if not all(rounds.get(k) for k in ("sidecar", "anchor")):
        return None
    rates = [stats.median([r["requests_per_s"] for r in rounds[k]]) for k in ("sidecar", "anchor")]
    if not all(x > 0 for x in rates):
        return None
    return round(PACED_SHARE * min(rates), 1)


def _us(cpu_s: float, n: int) -> float:
    return cpu_s / n * 1e6 if n else math.nan


def fleet_figures(rounds: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Medians over rounds per worker kind, and the sidecar-vs-anchor ratios (I/O-free)."""
    out: dict[str, Any] = {}
    for kind, runs in rounds.items():
        if not runs:
            continue
        out[kind] = {
            "tokens_per_s": stats.median([r["tokens_per_s"] for r in runs]),
            "requests_per_s": stats.median([r["requests_per_s"] for r in runs]),
            "ttft_p50_ms": stats.median([r["ttft_ms"]["p50"] for r in runs]),
            "ttft_p90_ms": stats.median([r["ttft_ms"]["p90"] for r in runs]),
            "worker_cpu_us_per_token": stats.median(
                [_us(r["cpu_s"]["worker"], r["out_tokens"]) for r in runs]
            ),
            "worker_cpu_us_per_request": stats.median(
                [_us(r["cpu_s"]["worker"], r["completed"]) for r in runs]
            ),
            "frontend_cpu_us_per_request": stats.median(
                [_us(r["cpu_s"]["frontend"], r["completed"]) for r in runs]
            ),
            "engine_cpu_us_per_token": stats.median(
                [_us(r["cpu_s"].get("engine", math.nan), r["out_tokens"]) for r in runs]
            ),
            "errors": sum(r["errors"] for r in runs),
            "rounds_tokens_per_s": [r["tokens_per_s"] for r in runs],
        }
    side, anchor = out.get("sidecar"), out.get("anchor")
    ratios: dict[str, float] = {}
    if side and anchor:
        ratios["tokens_per_s_vs_anchor"] = analysis.ratio(side["tokens_per_s"], anchor["tokens_per_s"])
        ratios["ttft_p50_minus_anchor_ms"] = side["ttft_p50_ms"] - anchor["ttft_p50_ms"]
        ratios["worker_cpu_per_token_vs_anchor"] = analysis.ratio(
            side["worker_cpu_us_per_token"], anchor["worker_cpu_us_per_token"]
        )
        ratios["worker_cpu_per_request_vs_anchor"] = analysis.ratio(
            side["worker_cpu_us_per_request"], anchor["worker_cpu_us_per_request"]
        )
    out["ratios"] = ratios
    return out
