"""The scenarios of ``openengine-sidecar bench`` (docs/PERFORMANCE.md), each returning a JSON-able dict.

One :class:`Bench` holds the run's engine and main sidecar; scenarios that must start
from a fresh process (scale: RSS; drain: it ends the process) start their own sidecar
in front of the same engine. Every client runs in its own worker process
(:func:`~sidecar.bench.procs.run_worker`); through-sidecar and direct runs alternate in
the same run, so their ratios hold on a noisy machine.
"""

from __future__ import annotations

import itertools
import math
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from sidecar.bench import analysis, fleet, procs, profile, stats
from sidecar.bench.config import BenchConfig


class Bench:
    """The run's shared state: config, engine, main sidecar, progress output."""

    def __init__(
        self,
        config: BenchConfig,
        tmp: Path,
        engine: procs.Proc,
        engine_address: str,
        sidecar: procs.SidecarProcess,
        *,
        pb2_dir: Path | None,
        model: str,
        say: Callable[[str], None],
    ) -> None:
        self.config = config
        self.tmp = tmp
        self.engine = engine
        self.engine_address = engine_address
        self.sidecar = sidecar
        self.pb2_dir = pb2_dir
        self.model = model
        self.say = say
        self._nonces = itertools.count(1)

    def spec(self, mode: str, *, sidecar: procs.SidecarProcess | None = None, **kw: Any) -> dict[str, Any]:
        sc = sidecar or self.sidecar
        spec = {
            "mode": mode,
            "model": self.model,
            "url": sc.ws,
            "engine": self.engine_address,
            "pb2_dir": str(self.pb2_dir) if self.pb2_dir else None,
            "nonce": f"bench{next(self._nonces)}-{time.time_ns() % 10**9}",
            "encoding": self.config.encoding,
            "coalesce": self.config.coalesce,
            "pids": {"sidecar": sc.proc.pid, "engine": self.engine.pid},
        }
        spec.update(kw)
        return spec

    async def settle(self, timeout: float = 20) -> dict[str, Any]:
        """Wait until the engine is idle (nothing open, nothing in flight); its counters. What is
        still held after ``timeout`` is reported and aborted, so the next measurement starts clean
        (callers that count leaks read the counters first)."""
        idle, counters = await procs.wait_engine_idle(self.engine_address, timeout)
        if not idle:
            self.say(
                f"  ! engine not idle after {timeout:.0f}s: {counters.get('streams_open')} streams open, "
                f"{counters.get('requests_in_flight')} requests in flight; aborting them"
            )
            await self.clean()
        return counters

    async def clean(self) -> None:
        """Abort whatever the engine still holds (after a scenario counted it as leaked)."""
        await procs.abort_everything(self.engine_address)
        await procs.wait_engine_idle(self.engine_address, 30)


# --- relay throughput + CPU per token -------------------------------------------------------------


async def relay(b: Bench) -> dict[str, Any]:
    c = b.config
    kinds = ["sidecar", "engineclient"] + (["grpcio"] if b.pb2_dir else [])
    rounds: dict[str, list[dict[str, Any]]] = {k: [] for k in kinds}
    common: dict[str, Any] = {"streams": c.streams, "tokens": c.tokens, "connections": c.connections}
    for r in range(c.rounds):
        for kind in kinds:
            await b.settle()
            res = await procs.run_worker(b.spec(f"relay-{kind}", **common))
            rounds[kind].append(res)
            line = f"  relay round {r + 1}/{c.rounds} {kind:<12} {res['tokens_per_s']:>9,.0f} tok/s"
            line += f"  client {analysis.per_token_us(res['cpu_s']['self'], res['tokens']):5.1f} µs/tok"
            if kind == "sidecar":
                line += (
                    f"  sidecar {analysis.per_token_us(res['cpu_s']['sidecar'], res['tokens']):5.1f} µs/tok"
                )
            b.say(line)
    out = analysis.relay_figures(rounds)
    out["config"] = {**common, "rounds": c.rounds, "encoding": c.encoding, "coalesce": c.coalesce}
    out["runs"] = rounds
    if c.profile_dir is not None:
        out["profile"] = await _profile_relay(b, common)
    return out


async def _profile_relay(b: Bench, common: dict[str, Any]) -> dict[str, Any]:
    """One extra (uncounted) through-sidecar relay round with py-spy sampling the sidecar."""
    return await profile_round(b, "sidecar-relay", b.sidecar.proc.pid, b.spec("relay-sidecar", **common))


async def profile_round(b: Bench, name: str, pid: int, spec: dict[str, Any]) -> dict[str, Any]:
    """One extra (uncounted) worker run of ``spec`` with py-spy sampling process ``pid``; the
    collapsed stacks go to ``<profile dir>/<name>.txt`` and a summary into the results."""
    c = b.config
    assert c.profile_dir is not None
    c.profile_dir.mkdir(parents=True, exist_ok=True)
    raw = c.profile_dir / f"{name}.txt"
    await b.settle()
    spy = profile.record(pid, 3600, raw, rate=100)
    if spy is None:
        b.say("  profile: py-spy not found (pip install py-spy); skipped")
        return {"error": "py-spy not installed"}
    try:
        await trio.sleep(1)  # py-spy attaches
        res = await procs.run_worker(spec, timeout=900)
    finally:
        spy.send_signal(signal.SIGINT)
        with trio.move_on_after(30):
            await trio.to_thread.run_sync(spy.wait)
        if spy.returncode is None:
            spy.kill()
    if not raw.exists():
        return {"error": "py-spy wrote no profile (ptrace permission?)"}
    summary = profile.summarize(raw.read_text(), top=40)
    b.say(f"  profile of {name} -> {raw}")
    for line in profile.render(summary, 15).splitlines():
        b.say("    " + line)
    keep = {k: res[k] for k in ("tokens_per_s", "requests_per_s") if k in res}
    return {"file": str(raw), "while_sampled": keep, **summary}


# --- short requests --------------------------------------------------------------------------------


async def short(b: Bench) -> dict[str, Any]:
    c = b.config
    common: dict[str, Any] = {
        "concurrency": c.short_concurrency,
        "seconds": c.short_seconds,
        "connections": c.connections,
    }
    out: dict[str, Any] = {"config": {**common, "rounds": c.short_rounds}}
    kinds = ["sidecar", "engineclient"] + (["grpcio"] if b.pb2_dir else [])
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in kinds}
    for _ in range(c.short_rounds):
        for kind in kinds:
            await b.settle()
            res = await procs.run_worker(b.spec(f"short-{kind}", **common))
            runs[kind].append(res)
            busy = {k: v / res["seconds"] for k, v in res["cpu_s"].items()}
            res["cpu_share"] = busy
            who = "sidecar" if kind == "sidecar" else "self"
            b.say(
                f"  short {kind:<12} {res['requests_per_s']:>8,.0f} req/s  "
                f"p50 {res['latency_ms']['p50']:.1f} ms  p99 {res['latency_ms']['p99']:.1f} ms  "
                f"{analysis.per_token_us(res['cpu_s'][who], res['completed']):,.0f} µs CPU/req  "
                f"(CPU busy: " + ", ".join(f"{k} {v:.0%}" for k, v in busy.items()) + ")"
            )
    out.update(analysis.short_figures(runs))
    out["runs"] = runs
    if c.profile_dir is not None:
        out["profile"] = await profile_round(
            b, "sidecar-short", b.sidecar.proc.pid, b.spec("short-sidecar", **common)
        )
    return out


# --- burst: N streams at the same instant ---------------------------------------------------------


def burst_clients(b: Bench) -> dict[str, dict[str, Any]]:
    """Client kind -> worker spec overrides (the JSON client needs ``websockets``, grpcio its bindings)."""
    import importlib.util

    kinds: dict[str, dict[str, Any]] = {}
    if importlib.util.find_spec("websockets") is not None:
        kinds["json"] = {"mode": "burst-json", "encoding": "json", "coalesce": False}
    kinds["lean-coalesced"] = {"mode": "burst-lean", "encoding": "msgpack", "coalesce": True}
    kinds["lean"] = {"mode": "burst-lean", "encoding": "msgpack", "coalesce": False}
    if b.pb2_dir is not None:
        kinds["grpcio"] = {"mode": "burst-grpcio"}
    kinds["engineclient"] = {"mode": "burst-engineclient"}
    return kinds


async def burst(b: Bench) -> dict[str, Any]:
    c = b.config
    kinds = burst_clients(b)
    if "json" not in kinds:
        b.say(
            "  burst: the plain JSON client needs the websockets library (pip install -e '.[dev]'); skipped"
        )
    out: dict[str, Any] = {
        "config": {
            "sizes": list(c.burst_sizes),
            "tokens": c.burst_tokens,
            "bursts_per_run": c.burst_bursts,
            "rounds": c.burst_rounds,
            "connections": c.connections,
        },
        "sizes": {},
    }
    for size in c.burst_sizes:
        runs: dict[str, list[dict[str, Any]]] = {k: [] for k in kinds}
        for _ in range(c.burst_rounds):
            for kind, over in kinds.items():
                await b.settle()
                spec = b.spec(
                    over["mode"],
                    streams=size,
                    tokens=c.burst_tokens,
                    bursts=c.burst_bursts,
                    connections=c.connections,
                )
                spec.update(over)
                runs[kind].append(await procs.run_worker(spec))
        fig = analysis.burst_figures(runs, size * c.burst_bursts * c.burst_rounds)
        if c.profile_dir is not None and "json" in kinds:
            spec = b.spec("burst-json", streams=size, tokens=c.burst_tokens, bursts=c.burst_bursts)
            spec.update(kinds["json"], connections=c.connections)
            fig["profile"] = await profile_round(b, f"sidecar-burst{size}", b.sidecar.proc.pid, spec)
        out["sizes"][str(size)] = fig
        ref = fig.get("reference", "-")
        for kind, f in fig["clients"].items():
            added = f.get("added_ttft_ms")
            b.say(
                f"  burst {size:>4} {kind:<15} TTFT p50 {f['ttft_ms']['p50']:7.2f} p99 {f['ttft_ms']['p99']:7.2f} ms"
                + (f"  added vs {ref} p50 {added['p50']:+7.2f} p99 {added['p99']:+7.2f} ms" if added else "")
                + f"  completed {f['completed']}/{f['expected']}"
                + (
                    f"  sidecar {f['sidecar_cpu_us_per_request']:,.0f} µs/req"
                    if f.get("sidecar_cpu_us_per_request") is not None
                    else ""
                )
            )
    return out


# --- latency -------------------------------------------------------------------------------------------


async def latency(b: Bench) -> dict[str, Any]:
    c = b.config
    common: dict[str, Any] = {
        "streams": c.latency_streams,
        "tokens": c.latency_tokens,
        "token_delay_ms": 1000.0 / c.latency_rate,
        "ramp_s": c.latency_ramp_s,
        "connections": c.connections,
    }
    out: dict[str, Any] = {
        "config": {**common, "tokens_per_s_per_stream": c.latency_rate, "concurrent": True}
    }
    await b.settle()

    async def one(kind: str) -> None:
        out[kind] = await procs.run_worker(b.spec(f"latency-{kind}", **common))

    # Both at once: on a shared machine they then see the same noise, so the difference of their
    # distributions is what the sidecar adds (each stream's engine stamp makes it exact per token).
    async with trio.open_nursery() as nursery:
        for kind in ("sidecar", "engineclient"):
            nursery.start_soon(one, kind)
    for kind in ("sidecar", "engineclient"):
        res = out[kind]
        b.say(
            f"  latency {kind:<12} TTFT p50 {res['ttft_ms']['p50']:.2f} p99 {res['ttft_ms']['p99']:.2f} ms; "
            f"ITL p50 {res['itl_ms']['p50']:.2f} p99 {res['itl_ms']['p99']:.2f} ms; "
            f"engine→client p50 {res['oneway_ms']['p50']:.2f} p99 {res['oneway_ms']['p99']:.2f} ms"
        )
    out["added"] = analysis.latency_added(out["sidecar"], out["engineclient"])
    a = out["added"]
    b.say(
        f"  latency added by the sidecar: TTFT p50 {a['ttft_ms']['p50']:+.2f} p99 {a['ttft_ms']['p99']:+.2f} ms; "
        f"ITL p50 {a['itl_ms']['p50']:+.2f} p99 {a['itl_ms']['p99']:+.2f} ms; "
        f"per token p50 {a['oneway_ms']['p50']:+.2f} p99 {a['oneway_ms']['p99']:+.2f} ms"
    )
    return out


# --- cancellation storm -------------------------------------------------------------------------------


async def cancel(b: Bench) -> dict[str, Any]:
    c = b.config
    common: dict[str, Any] = {
        "streams": c.cancel_streams,
        "tokens": 8000,
        "token_delay_ms": c.cancel_token_delay_ms,
        "ramp_s": c.cancel_ramp_s,
        "window_s": c.cancel_window_s,
        "disconnect_group": c.cancel_disconnect_group,
        "connections": c.connections,
    }
    out: dict[str, Any] = {"config": common}
    for kind in ("sidecar", "engineclient"):
        await b.settle()
        before = await procs.engine_counters(b.engine_address)
        res = await procs.run_worker(b.spec(f"cancel-{kind}", **common))
        idle, counters = await procs.wait_engine_idle(b.engine_address, 10)
        seen = (await procs.engine_counters(b.engine_address, cancel_times=True)).get("cancel_seen_us", {})
        if not idle:
            await b.clean()  # what leaked is counted below
        fig = analysis.cancel_figures(res["records"], seen)
        fig["leaked"] = analysis.leaks(counters)
        fig["engine_idle"] = idle
        fig["engine_delta"] = {
            k: counters.get(k, 0) - before.get(k, 0)
            for k in (
                "requests_accepted",
                "requests_cancelled_by_client",
                "requests_aborted",
                "orphans_aborted",
            )
        }
        fig["streams"] = res["streams"]
        fig["open_s"] = res["open_s"]
        fig["storm_cpu_s"] = res["cpu_s"]
        if "cancel_frame_ends" in res:
            fig["cancel_frame_ends"] = res["cancel_frame_ends"]
        out[kind] = fig
        lat = fig["latency_ms"]
        b.say(
            f"  cancel {kind:<12} {fig['cancels']} cancels: engine saw them after p50 {lat['p50']:.2f} "
            f"p99 {lat['p99']:.2f} max {lat['max']:.2f} ms; leaked {fig['leaked']}; "
            f"never reached the engine {sum(fig['not_seen_by_engine'].values())}; CPU during the storm: "
            + ", ".join(f"{k} {v:.2f} s" for k, v in res["cpu_s"].items())
        )
    return out


# --- scale: RSS per idle stream -------------------------------------------------------------------------


async def scale(b: Bench) -> dict[str, Any]:
    c = b.config
    points = []
    for n in c.scale_points:
        async with procs.sidecar(b.engine_address, command=c.sidecar_command) as sc:
            await b.settle()
            conns = max(1, math.ceil(n / c.scale_streams_per_connection))
            warm = b.spec("idle-sidecar", sidecar=sc, streams=min(20, n), connections=1)
            await procs.run_worker(warm)
            await b.settle()
            await trio.sleep(0.5)
            base = stats.rss_kib(sc.proc.pid)
            seen: dict[str, Any] = {}

            async def armed(
                info: dict[str, Any], sc: procs.SidecarProcess = sc, seen: dict[str, Any] = seen
            ) -> None:
                await trio.sleep(1.0)
                seen["rss"] = stats.rss_kib(sc.proc.pid)
                seen["engine"] = await procs.engine_counters(b.engine_address)
                seen.update(info)

            res = await procs.run_worker(
                b.spec("idle-sidecar", sidecar=sc, streams=n, connections=conns), on_armed=armed, timeout=900
            )
            # every stream's connection is gone: how long until the engine holds nothing?
            t0 = trio.current_time()
            idle, counters = await procs.wait_engine_idle(b.engine_address, 120 if not c.quick else 20)
            cleanup_s = trio.current_time() - t0 if idle else math.nan
            leaked = analysis.leaks(counters)
            after = stats.rss_kib(sc.proc.pid)
            if not idle:
                await b.clean()
        per = (seen["rss"] - base) / n
        point = {
            "streams": n,
            "connections": conns,
            "rss_base_kib": base,
            "rss_open_kib": seen["rss"],
            "rss_after_close_kib": after,
            "rss_kib_per_stream": per,
            "open_s": res["open_s"],
            "engine_streams_open": seen["engine"]["streams_open"],
            "cleanup_s": cleanup_s,
            "leaked_after_close": leaked,
        }
        points.append(point)
        b.say(
            f"  scale {n:>6,} idle streams over {conns} connections: sidecar RSS {base / 1024:.1f} -> "
            f"{seen['rss'] / 1024:.1f} MiB = {per:.1f} KiB/stream (opened in {res['open_s']:.1f} s; "
            f"engine had {seen['engine']['streams_open']:,.0f} open); after the clients left, the engine "
            f"was idle in {cleanup_s:.1f} s (leaked {leaked}); RSS then {after / 1024:.1f} MiB"
        )
    return {"points": points}


# --- KV bridge ----------------------------------------------------------------------------------------------


async def kv(b: Bench) -> dict[str, Any]:
    c = b.config
    spec = {"mode": "kv", "batches": c.kv_batches, "rate": c.kv_rate, "seconds": c.kv_seconds}
    res = await procs.run_worker(spec)
    blast, paced = res["blast"], res["paced"]
    b.say(
        f"  kv blast {blast['events']:,} events: bridge output {blast['bridge_events_per_s']:,.0f} ev/s, "
        f"{blast['events_per_bridge_cpu_s']:,.0f} events per bridge CPU-second, lost {blast['lost_batches']}"
    )
    lat = paced["added_latency_ms"]
    b.say(
        f"  kv paced at {paced['target_events_per_s']:,} ev/s: bridge {paced['bridge_events_per_s']:,.0f} ev/s, "
        f"added latency p50 {lat['p50']:.2f} p99 {lat['p99']:.2f} ms, lost {paced['lost_batches']}"
    )
    return res


# --- drain ---------------------------------------------------------------------------------------------------


async def drain(b: Bench) -> dict[str, Any]:
    c = b.config
    grace = c.drain_grace_s
    info: dict[str, Any] = {}
    async with procs.sidecar(
        b.engine_address, "--drain-timeout", str(grace), command=c.sidecar_command
    ) as sc:
        await b.settle()
        spec = b.spec(
            "drain-sidecar",
            sidecar=sc,
            streams=c.drain_streams,
            tokens=8000,
            token_delay_ms=100.0,
            connections=c.connections,
            timeout_s=grace + 30,
        )

        async def armed(_: dict[str, Any]) -> None:
            info["signal_ns"] = time.time_ns()
            sc.proc.process.send_signal(signal.SIGTERM)
            with trio.move_on_after(grace + 30):
                info["returncode"] = await sc.proc.process.wait()
            info["exit_ns"] = time.time_ns()

        res = await procs.run_worker(spec, on_armed=armed, timeout=grace + 120)
    counters = await b.settle()
    exit_s = (info["exit_ns"] - info["signal_ns"]) / 1e9 if "returncode" in info else math.nan
    last_end_s = (res["last_end_ns"] - info["signal_ns"]) / 1e9 if res["last_end_ns"] else math.nan
    out = {
        "streams": c.drain_streams,
        "grace_s": grace,
        "exit_s": exit_s,
        "exit_code": info.get("returncode"),
        "last_end_after_signal_s": last_end_s,
        "outcomes": res["outcomes"],
        "close_codes": res["close_codes"],
        "leaked": analysis.leaks(counters),
    }
    b.say(
        f"  drain {c.drain_streams} streams in flight, grace {grace:g} s: exit {exit_s:.2f} s after SIGTERM "
        f"(code {info.get('returncode')}), last end at {last_end_s:.2f} s, ends {res['outcomes']}, "
        f"leaked {out['leaked']}"
    )
    return out


# --- vllm (optional) -------------------------------------------------------------------------------------


async def vllm(b: Bench) -> dict[str, Any]:
    """The sidecar in front of real vLLM (``sidecar.bench.vllm_bench``; needs the ``vllm`` extra)."""
    from sidecar.bench.vllm_bench import vllm as run

    return await run(b)


async def openai(b: Bench) -> dict[str, Any]:
    """The OpenAI front vs EngineClient, and vs ``vllm serve`` (``sidecar.bench.openai_bench``)."""
    from sidecar.bench.openai_bench import openai as run

    return await run(b)


RUNNERS = {
    "relay": relay,
    "short": short,
    "burst": burst,
    "latency": latency,
    "cancel": cancel,
    "scale": scale,
    "kv": kv,
    "drain": drain,
    "dynamo": fleet.dynamo,
    "vllm": vllm,
    "openai": openai,
}
