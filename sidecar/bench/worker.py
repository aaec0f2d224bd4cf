"""One benchmark client process: ``python -m sidecar.bench.worker SPEC-JSON``.

The orchestrator runs every client in its own process, so each one's CPU can be read
from ``/proc`` and none of them shares an interpreter with what it measures. Protocol on
stdout, one JSON object per line: ``{"event": "armed", ...}`` (scenarios that wait for the
orchestrator, which then answers ``go`` on stdin) and finally ``{"event": "result", ...}``
or ``{"event": "error", "message": ...}``.

``spec["pids"]`` names other processes whose CPU time is sampled at the same instants as
the worker's own (``cpu_s`` in results: ``self``, and one entry per named pid).
"""

from __future__ import annotations

import json
import sys
import traceback
from collections.abc import Callable
from functools import partial
from typing import Any

import trio

from sidecar.bench import burst_load, direct_load, fleet_load, north_load, openai_load, stats, vllm_load


def _cpu_sampler(pids: dict[str, int]) -> Callable[[], dict[str, float]]:
    def sample() -> dict[str, float]:
        out = {"self": stats.cpu_seconds("self")}
        for name, pid in pids.items():
            try:
                out[name] = stats.cpu_seconds(pid)
            except (OSError, IndexError):
                out[name] = float("nan")
        return out

    return sample


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


async def _armed(info: dict[str, Any]) -> None:
    """Tell the orchestrator we are ready and wait for its ``go``."""
    _emit({"event": "armed", **info})
    await trio.to_thread.run_sync(sys.stdin.readline)


TRIO_MODES: dict[str, Any] = {
    "relay-sidecar": north_load.relay,
    "short-sidecar": north_load.short,
    "latency-sidecar": north_load.latency,
    "cancel-sidecar": north_load.cancel_storm,
    "relay-engineclient": direct_load.relay_engineclient,
    "short-engineclient": direct_load.short_engineclient,
    "latency-engineclient": direct_load.latency_engineclient,
    "cancel-engineclient": direct_load.cancel_engineclient,
    "fleet": fleet_load.fleet,
    "burst-lean": burst_load.burst_lean,
    "burst-engineclient": burst_load.burst_engineclient,
    "openai-front": openai_load.through_front,
    "openai-engineclient": openai_load.engineclient,
}
#: Modes on asyncio (grpcio, websockets): plain functions that run their own loop.
ASYNCIO_MODES: dict[str, Any] = {
    "relay-grpcio": direct_load.relay_grpcio,
    "short-grpcio": direct_load.short_grpcio,
    "burst-grpcio": burst_load.burst_grpcio,
    "burst-json": burst_load.burst_json,
}
ARMED_MODES: dict[str, Any] = {"idle-sidecar": north_load.idle, "drain-sidecar": north_load.drain}
#: Modes that take both the CPU sampler and the armed handshake.
SYNCED_MODES: dict[str, Any] = {"vllm-sidecar": vllm_load.through_sidecar, "vllm-direct": vllm_load.direct}


def run(spec: dict[str, Any]) -> dict[str, Any]:
    mode = spec["mode"]
    cpu = _cpu_sampler({k: int(v) for k, v in spec.get("pids", {}).items()})
    if mode in ASYNCIO_MODES:
        out: dict[str, Any] = ASYNCIO_MODES[mode](spec, cpu)
        return out
    if mode == "kv":
        from sidecar.bench import kvbench

        return kvbench.run(spec)
    if mode in TRIO_MODES:
        result: dict[str, Any] = trio.run(partial(TRIO_MODES[mode], spec, cpu))
        return result
    if mode in ARMED_MODES:
        result = trio.run(partial(ARMED_MODES[mode], spec, _armed))
        return result
    if mode in SYNCED_MODES:
        result = trio.run(partial(SYNCED_MODES[mode], spec, cpu, _armed))
        return result
    raise SystemExit(f"unknown worker mode {mode!r}")


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    try:
        result = run(spec)
    except Exception as err:
        _emit({"event": "error", "message": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()})
        return 1
    _emit({"event": "result", **result})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
