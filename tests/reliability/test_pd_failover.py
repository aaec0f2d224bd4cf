"""P/D failover under faults, end to end and under CPU contention: the first prefill worker is
dead, refusing or hung; every flow must switch to the second prefill within a bound and
complete — context-first (vLLM flavour) and client bootstrap (SGLang flavour).

Faults on the first prefill worker (its sidecar ``sp1``, its engine ``p1``):

- ``dead``: the sidecar is killed — connections refused;
- ``refusing``: the engine is killed — the sidecar answers, not ready, refuses retryably
  (in bootstrap, the decode's transfer from the dead engine fails at the same moment);
- ``hung-engine``: the engine is frozen (SIGSTOP) — its sidecar fails the stream once its
  HTTP/2 PINGs go unanswered;
- ``hung-sidecar``: the sidecar is frozen (SIGSTOP) — the coordinator's WebSocket PINGs go
  unanswered (or ``describe`` times out).

A busy-loop process runs throughout (the bootstrap race that made 6-7 of 20 flows fail only
showed on a busy machine). Ground truth: the healthy engines' counters (every flow served
once, nothing leaked) and, after SIGCONT, the frozen engine's.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from sidecar.client.disagg import open_disagg
from tests.e2e.harness import generate_request, mock_engine, sidecar, spawn_argv, wait_engine_idle
from tests.reliability.test_hung_engine import SIDECAR_ARGS, SLACK, assert_no_leak

pytestmark = pytest.mark.subprocess

FLOWS = 4
#: The coordinator's PING liveness of its sidecar connections, and its describe bound.
CLIENT = {"keepalive_interval": 1.0, "keepalive_timeout": 2.0, "describe_timeout": 2.0}
PD_ARGS = [*SIDECAR_ARGS, "--no-kv-events"]
#: Time for the first flow to switch to the second prefill, per fault (short timers above):
#: dead / refusing: at once; hung engine: its sidecar's Health probe (interval + call timeout)
#: plus the PING timeout; hung sidecar: the coordinator's PING interval + timeout + the
#: confirming PING (``min(timeout, CONFIRM_TIMEOUT)``), or describe.
SWITCH = {"dead": 1.0, "refusing": 1.0, "hung-engine": 0.5 + 1.5 + 2.0, "hung-sidecar": 1.0 + 2.0 + 2.0}


@asynccontextmanager
async def busy_loop() -> AsyncIterator[None]:
    """A process spinning on one CPU for the duration (contention, not a fault of the system)."""
    async with spawn_argv([sys.executable, "-c", "while True: pass"], label="busy-loop"):
        yield


@pytest.mark.parametrize("fault", ["dead", "refusing", "hung-engine", "hung-sidecar"])
@pytest.mark.parametrize("flavor", ["vllm", "sglang"])
async def test_flows_fail_over_to_the_next_prefill(
    aio_loop: Any, tmp_path: Path, flavor: str, fault: str
) -> None:
    engine_args = [
        "--flavor",
        flavor,
        "--token-delay-ms",
        "5",
        "--orphans",
        "hold",
        "--orphan-timeout",
        "300",
    ]
    if flavor == "sglang":
        engine_args += ["--bootstrap-timeout", "60"]  # a failover must not rely on it
    with trio.fail_after(180):
        async with (
            busy_loop(),
            mock_engine(tmp_path, *engine_args, "--role", "prefill", name="p1") as p1,
            mock_engine(tmp_path, *engine_args, "--role", "prefill", name="p2") as p2,
            mock_engine(tmp_path, *engine_args, "--role", "decode", name="d") as d,
            sidecar(p1.address, *PD_ARGS) as sp1,
            sidecar(p2.address, *PD_ARGS) as sp2,
            sidecar(d.address, *PD_ARGS) as sd,
            open_disagg([sp1.ws, sp2.ws], [sd.ws], **CLIENT) as coordinator,
        ):
            # one flow on the healthy pair first: the coordinator holds a connection to sp1
            async with coordinator.generate(generate_request("warm up", max_tokens=3)) as flow:
                async for _ in flow:
                    pass
            assert flow.check().prefill == sp1.ws
            if fault == "dead":
                sp1.proc.process.kill()
            elif fault == "refusing":
                p1.proc.process.kill()
            elif fault == "hung-engine":
                p1.proc.signal(signal.SIGSTOP)
            else:
                sp1.proc.signal(signal.SIGSTOP)
            took = []
            for i in range(FLOWS):
                t0 = trio.current_time()
                async with coordinator.generate(generate_request(f"flow {i}", max_tokens=4)) as flow:
                    tokens = [e async for e in flow]
                end = flow.check()
                took.append(trio.current_time() - t0)
                assert end.prefill == sp2.ws and end.decode == sd.ws, end
                assert len(tokens) >= 4
                first = end.attempts[0]
                assert first.role == "prefill" and first.url == sp1.ws, end.attempts
                # sp1's prefill failed retryable — or, in bootstrap, the decode's transfer from the
                # dead prefill failed first and the coordinator cancelled that prefill (the race
                # tests/client/test_disagg_flow.py pins down; CI saw it): sp1 is replaced either way
                decode_failed_first = (
                    flavor == "sglang"
                    and first.result == "cancelled"
                    and end.attempts[1].role == "decode"
                    and end.attempts[1].result == "failed"
                )
                assert first.retryable or decode_failed_first, end.attempts
            assert took[0] < SWITCH[fault] + SLACK, took
            assert max(took[1:]) < SWITCH[fault] + SLACK, took
            for engine in (p2, d):
                counters = await wait_engine_idle(engine.address, timeout=30)
                assert_no_leak(counters)
            assert (await wait_engine_idle(p2.address))["requests_completed"] == FLOWS
            if fault == "hung-engine":
                p1.proc.signal(signal.SIGCONT)
                assert_no_leak(await wait_engine_idle(p1.address, timeout=60))
            elif fault == "hung-sidecar":
                sp1.proc.signal(signal.SIGCONT)
            print(f"{flavor} {fault}: switch times {', '.join(f'{t:.2f}s' for t in took)}")
