"""``openengine-sidecar bench``: what the sidecar costs, against direct clients in the same run.

Starts a fast-mode simulated engine and the sidecar as separate processes, drives them
with client worker processes, and compares with two anchors reading the same engine
directly — the sidecar's own ``EngineClient`` and grpcio's asyncio API with the official
protobuf runtime — in the same run, so ratios hold on a noisy machine. Prints progress,
a results table and the goals table; writes every figure and the machine
description as JSON (``--out``, by default under the git-ignored ``bench-results/``). Every flag
also reads ``OPENENGINE_SIDECAR_BENCH_<FLAG>``.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import signal
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import click
import trio

from sidecar.bench import analysis, machine, procs, report
from sidecar.bench.config import OPTIONAL_SCENARIOS, SCENARIOS, BenchConfig
from sidecar.bench.pb2 import Pb2Unavailable, generate_pb2
from sidecar.bench.scenarios import RUNNERS, Bench
from sidecar.cli_common import CommandError
from sidecar.cli_options import NewDir, NewFile, command_option

#: Where results go by default (git-ignored).
DEFAULT_OUT = Path("bench-results") / "bench-results.json"

_opt = command_option("bench")


def _scenarios(ctx: click.Context, param: click.Parameter, value: str) -> tuple[str, ...]:
    names = tuple(s.strip() for s in value.split(",") if s.strip())
    known = SCENARIOS + OPTIONAL_SCENARIOS
    unknown = [s for s in names if s not in known]
    if unknown or not names:
        raise click.BadParameter(f"unknown {unknown or value!r}; known: {', '.join(known)}", ctx, param)
    return names


def _scale_points(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[int, ...] | None:
    if value is None:
        return None
    try:
        points = tuple(int(x) for x in value.split(","))
    except ValueError:
        points = ()
    if not points or min(points) < 1:
        raise click.BadParameter(f"{value!r}: expected positive integers, comma-separated", ctx, param)
    return points


def _jsonable(obj: Any) -> Any:
    """NaN/inf become None (JSON has no NaN); paths become strings."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    return obj


async def run_bench(config: BenchConfig, say: Any = print) -> dict[str, Any]:
    """Run ``config.scenarios``; returns the full results document (also written to ``config.out``)."""
    started = time.monotonic()

    def progress(msg: str) -> None:
        say(f"[{time.monotonic() - started:7.1f}s] {msg}")

    doc: dict[str, Any] = {
        "command": " ".join(["openengine-sidecar", "bench", *sys.argv[2:]])
        if sys.argv[1:2] == ["bench"]
        else None,
        "started_unix": time.time(),
        "machine": machine.describe(),
        "config": {k: v for k, v in config.__dict__.items()},
        "results": {},
        "errors": {},
        "load_average": {},  # 1-minute load average at the start and end of each scenario
    }
    progress(
        f"bench: {', '.join(config.scenarios)}{' (quick)' if config.quick else ''} on "
        f"{doc['machine']['cores']} x {doc['machine']['cpu_model']}, load {os.getloadavg()[0]:.2f}"
    )
    with tempfile.TemporaryDirectory(prefix="oe-bench-") as tmp_s:
        tmp = Path(tmp_s)
        pb2_dir: Path | None = None
        if any(s in config.scenarios for s in ("relay", "short", "burst", "dynamo")):
            try:
                pb2_dir = generate_pb2(tmp / "pb2")
            except Pb2Unavailable as err:
                progress(f"grpcio anchor unavailable: {err}")
                doc["errors"]["grpcio"] = str(err)
        eopts = procs.EngineOptions(
            max_concurrent_streams=config.engine_stream_limit,
            lean_load_attributes=config.engine_lean_load,
        )
        async with procs.engine(tmp, eopts) as (eng, address):
            progress(f"engine (pid {eng.pid}) on {address}")
            async with procs.sidecar(address, command=config.sidecar_command) as sc:
                progress(f"sidecar (pid {sc.proc.pid}) on {sc.ws}")
                bench = Bench(config, tmp, eng, address, sc, pb2_dir=pb2_dir, model=eopts.model, say=progress)
                for name in config.scenarios:
                    load0 = os.getloadavg()[0]
                    progress(f"scenario {name} (load average {load0:.2f})")
                    try:
                        doc["results"][name] = await RUNNERS[name](bench)
                    except procs.BenchError as err:
                        progress(f"  ! {name} failed: {err}")
                        doc["errors"][name] = str(err)
                    doc["load_average"][name] = [load0, os.getloadavg()[0]]
                    _write(config.out, doc, started)  # partial results survive an interrupted run
    return _write(config.out, doc, started)


async def _until_signal(config: BenchConfig) -> dict[str, Any] | None:
    """``run_bench``, stopped cleanly (every child process ended) by SIGINT or SIGTERM: None then."""
    result: dict[str, Any] | None = None
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:

            async def watch() -> None:
                async for _ in signals:
                    nursery.cancel_scope.cancel()
                    return

            async def main() -> None:
                nonlocal result
                result = await run_bench(config)
                nursery.cancel_scope.cancel()

            nursery.start_soon(watch)
            nursery.start_soon(main)
    return result


def _write(path: Path, doc: dict[str, Any], started: float) -> dict[str, Any]:
    doc["goals"] = analysis.goals(doc["results"])
    doc["machine"]["loadavg_end"] = os.getloadavg()
    doc["seconds"] = time.monotonic() - started
    out: dict[str, Any] = _jsonable(doc)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    return out


@click.command("bench")
@_opt(
    "--scenarios",
    default=",".join(SCENARIOS),
    show_default=True,
    callback=_scenarios,
    help="Comma-separated subset to run; 'vllm' (the sidecar in front of real vLLM, needs the 'vllm' "
    "extra) and 'openai' (the OpenAI front) run only when named.",
)
@_opt("--quick", is_flag=True, help="Tiny sizes: every scenario in seconds (smoke run).")
@_opt(
    "--out",
    type=NewFile(create_dirs=True, path_type=Path),
    default=DEFAULT_OUT,
    show_default=True,
    help="Results (JSON); its directory is created.",
)
@_opt("--streams", type=click.IntRange(1), default=None, help="Relay: concurrent streams [256].")
@_opt("--tokens", type=click.IntRange(1), default=None, help="Relay: tokens per stream [500].")
@_opt(
    "--rounds",
    type=click.IntRange(1),
    default=None,
    help="Rounds of each client in every scenario (relay, short, burst, dynamo, vllm) [3; --quick: 1].",
)
@_opt("--connections", type=click.IntRange(1), default=None, help="Load generator WebSocket connections [8].")
@_opt(
    "--encoding",
    type=click.Choice(["msgpack", "json"]),
    default="msgpack",
    show_default=True,
    help="Frame encoding of the load generator.",
)
@_opt("--coalesce/--no-coalesce", default=True, show_default=True, help="Opt in to coalesced event frames.")
@_opt(
    "--scale-points",
    default=None,
    callback=_scale_points,
    help="Scale: idle stream counts, comma-separated [1000,10000].",
)
@_opt(
    "--engine-stream-limit",
    type=click.IntRange(0),
    default=65536,
    show_default=True,
    help="HTTP/2 streams per connection the engine allows (0: grpclib's 100).",
)
@_opt(
    "--engine-load-attributes",
    type=click.Choice(["lean", "full"]),
    default="lean",
    show_default=True,
    help="GetLoad attributes the engine sends the sidecar: a real engine's few counters, or the "
    "simulated engine's full ground truth (tens to hundreds of KB, parsed by the sidecar every second).",
)
@_opt(
    "--sidecar-command",
    default="",
    help="Run the sidecar with this command instead of 'python -m sidecar' (shell words; it gets "
    "'run --engine ...' appended): A/B a patched build against the same anchors.",
)
@_opt(
    "--profile",
    "profile_dir",
    type=NewDir(path_type=Path),
    default=None,
    help="Also profile (py-spy) the sidecar during one extra round of relay, short and burst, and the "
    "Dynamo workers during one extra dynamo round each; write the collapsed stacks here.",
)
def bench(**kw: Any) -> None:
    """Measure what the sidecar costs per token, per request and per stream."""
    config = BenchConfig(
        scenarios=kw["scenarios"], out=kw["out"], encoding=kw["encoding"], coalesce=kw["coalesce"]
    )
    config = replace(
        config,
        engine_stream_limit=kw["engine_stream_limit"],
        engine_lean_load=kw["engine_load_attributes"] == "lean",
        profile_dir=kw["profile_dir"],
        sidecar_command=tuple(shlex.split(kw["sidecar_command"])),
    )
    if kw["quick"]:
        config = config.quick_sizes()
    for key in ("streams", "tokens", "connections"):
        if kw[key] is not None:
            config = replace(config, **{key: kw[key]})
    if kw["rounds"] is not None:
        config = config.with_rounds(kw["rounds"])
    if kw["scale_points"]:
        config = replace(config, scale_points=kw["scale_points"])
    doc = trio.run(_until_signal, config)
    if doc is None:
        raise CommandError(
            f"interrupted: stopped every process; results of finished scenarios are in {config.out}", 130
        )
    click.echo("")
    click.echo(report.render_table(doc["results"]))
    click.echo("")
    click.echo(report.render_goals(doc["goals"]))
    if doc["errors"]:
        click.echo(f"\nerrors: {json.dumps(doc['errors'], indent=2)[:4000]}")
    click.echo(f"\nwrote {config.out}")
