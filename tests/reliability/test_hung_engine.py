"""Hung engines, end to end: the whole process frozen (SIGSTOP), its Control service hung
(Health slow, Generate fine), its Generate path hung (Health fine). Real processes: the
simulated engine (its hang switches: SIGUSR1 / SIGUSR2, sidecar/mock/hangs.py) and
``openengine-sidecar run`` with short timers, so each bound below is a small multiple of them;
docs/RELIABILITY.md gives the same bounds for the defaults.

Each test asserts: bounded detection (``/ready`` 503 and why), streams in flight ending
``failed`` retryable within a bound (or, for a Control-only hang, completing), Aborts that do
not hold anything up, recovery once the engine runs again, and — from the engine's own
counters — zero leaked requests.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from sidecar.client.sidecar_client import SidecarClient, open_sidecar
from tests.e2e.harness import eventually, generate_request, mock_engine, sidecar, wait_engine_idle
from tests.reliability.helpers import scrape

pytestmark = pytest.mark.subprocess

HEALTH_INTERVAL, CALL_TIMEOUT = 0.5, 1.5
KEEPALIVE_INTERVAL, KEEPALIVE_TIMEOUT = 2.0, 2.0
INACTIVITY = 3.0
SIDECAR_ARGS = [
    "--inactivity-timeout",
    str(INACTIVITY),
    "--health-interval",
    str(HEALTH_INTERVAL),
    "--call-timeout",
    str(CALL_TIMEOUT),
    "--engine-keepalive-interval",
    str(KEEPALIVE_INTERVAL),
    "--engine-keepalive-timeout",
    str(KEEPALIVE_TIMEOUT),
    "--abort-timeout",
    "1",
]
ENGINE_ARGS = ["--flavor", "vllm", "--token-delay-ms", "20", "--orphans", "hold", "--orphan-timeout", "300"]
#: Slack for a shared, loaded 2-core machine on top of each computed bound.
SLACK = 4.0
#: Not ready after a hang: the first slow check starts within one interval, two in a row.
NOT_READY_BOUND = 2 * (HEALTH_INTERVAL + CALL_TIMEOUT) + SLACK


@dataclass
class Run:
    """One stream's fate: events, its end, and when (trio clock) it ended."""

    events: int = 0
    end: Any = None
    ended_at: float = 0.0
    started: trio.Event = field(default_factory=trio.Event)


async def stream(client: SidecarClient, run: Run, max_tokens: int, *, started_after: int = 3) -> None:
    async with client.generate(generate_request(max_tokens=max_tokens)) as s:
        async for _ in s:
            run.events += 1
            if run.events == started_after:
                run.started.set()
        run.end = s.end
    run.ended_at = trio.current_time()
    run.started.set()


async def cancel_stream(client: SidecarClient, go: trio.Event, out: dict[str, Any]) -> None:
    """A stream the client cancels once ``go`` is set: ``out`` gets its id, end and how long the
    cancel took to end it."""
    request = generate_request(max_tokens=2000, requestId="to-cancel")
    out["id"] = "to-cancel"
    async with client.generate(request) as s:
        async for _ in s:
            if go.is_set():
                break
        t0 = trio.current_time()
    out["took"] = trio.current_time() - t0
    out["end"] = s.end


async def ready(http: str) -> tuple[int, str]:
    async with httpx.AsyncClient() as c:
        r = await c.get(http + "/ready", timeout=5)
    return r.status_code, r.text


async def wait_ready(http: str, want: int, timeout: float) -> str:
    async def check() -> str | None:
        code, text = await ready(http)
        return text if code == want else None

    return str(await eventually(check, timeout, interval=0.1))


def assert_no_leak(c: dict[str, Any]) -> None:
    assert c["requests_leaked"] == 0 and c["orphans_expired"] == 0, c
    ended = (
        c["requests_completed"]
        + c["requests_failed"]
        + c["requests_cancelled_by_client"]
        + c["requests_aborted"]
        + c["requests_dropped"]
    )
    assert ended == c["requests_accepted"], c


async def test_frozen_engine_fails_streams_in_bounded_time_and_recovers(
    aio_loop: Any, tmp_path: Path
) -> None:
    """SIGSTOP mid-load: Health times out (not ready), the connections' PINGs go unanswered and
    they are closed, so every stream in flight ends ``failed`` retryable; new work is refused
    retryably; Aborts wait in the background for as long as the engine is lost. SIGCONT: ready
    again, serving; the queued Aborts reach the engine; nothing leaks."""
    with trio.fail_after(120):
        async with (
            mock_engine(tmp_path, *ENGINE_ARGS) as engine,
            # the inactivity timeout well above the PING bound: what is proved here is the PING;
            # a 2 s Abort retry window, far shorter than the freeze: Aborts wait while the engine
            # is lost, the window runs only while it is reachable
            sidecar(
                engine.address, *SIDECAR_ARGS, "--inactivity-timeout", "60", "--abort-retry-window", "2"
            ) as sc,
            open_sidecar(sc.ws) as client,
        ):
            runs = [Run() for _ in range(12)]
            async with trio.open_nursery() as nursery:
                for run in runs:
                    nursery.start_soon(stream, client, run, 2000)
                for run in runs:
                    await run.started.wait()
                engine.proc.signal(signal.SIGSTOP)
                t0 = trio.current_time()
                reason = await wait_ready(sc.http, 503, NOT_READY_BOUND)
                not_ready = trio.current_time() - t0
                assert "engine unreachable" in reason, reason
            failed = max(r.ended_at for r in runs) - t0
            bound = HEALTH_INTERVAL + CALL_TIMEOUT + KEEPALIVE_TIMEOUT + SLACK
            assert failed < bound, (failed, bound)
            for run in runs:
                assert run.end.outcome == "failed" and run.end.error.retryable, run.end
                assert "connection lost" in run.end.error.message or "unreachable" in run.end.error.message
            async with client.generate(generate_request(max_tokens=4)) as refused:
                async for _ in refused:
                    pass
            assert refused.end.outcome == "rejected" and refused.end.error.retryable
            m = await scrape(sc.http)
            assert m.value("openengine_sidecar_engine_keepalive_timeouts_total") >= 1
            await trio.sleep(3)  # the freeze outlasts the 2 s Abort retry window (the fault, not a wait)
            stopped_for = trio.current_time() - t0
            engine.proc.signal(signal.SIGCONT)
            t1 = trio.current_time()
            await wait_ready(sc.http, 200, 30)
            recovered = trio.current_time() - t1
            after = Run()
            await stream(client, after, 8)
            assert after.end.outcome == "completed"
            counters = await wait_engine_idle(engine.address, timeout=60)
            assert_no_leak(counters)
            assert sum(counters["aborts_received_by_id"].values()) >= len(runs)
            print(
                f"SIGSTOP: not ready after {not_ready:.1f}s, {len(runs)} streams failed within {failed:.1f}s; "
                f"SIGCONT after {stopped_for:.1f}s: ready again {recovered:.1f}s later; "
                f"orphans aborted {counters['orphans_aborted']:g}, leaked {counters['requests_leaked']:g}"
            )


async def test_control_service_hang_keeps_streams_and_turns_not_ready(aio_loop: Any, tmp_path: Path) -> None:
    """The Control service hangs (Health, Abort … wait; SIGUSR1): Generate streams in flight run
    to completion (their connections answer PINGs), the worker turns not ready within two
    health checks, a cancelled stream gets its ``end`` at once while its Abort waits in the
    background. SIGUSR1 again: ready, the queued Abort lands, nothing leaks."""
    with trio.fail_after(120):
        async with (
            mock_engine(tmp_path, *ENGINE_ARGS) as engine,
            sidecar(engine.address, *SIDECAR_ARGS) as sc,
            open_sidecar(sc.ws) as client,
        ):
            runs = [Run() for _ in range(6)]
            async with trio.open_nursery() as nursery:
                for run in runs:
                    nursery.start_soon(stream, client, run, 400)  # ~8 s each
                for run in runs:
                    await run.started.wait()
                cancel = trio.Event()
                cancelled: dict[str, Any] = {}
                nursery.start_soon(cancel_stream, client, cancel, cancelled)
                engine.proc.signal(signal.SIGUSR1)
                t0 = trio.current_time()
                cancel.set()  # the client cancels one stream while Abort cannot reach the engine
                reason = await wait_ready(sc.http, 503, NOT_READY_BOUND)
                not_ready = trio.current_time() - t0
                assert "engine unreachable" in reason, reason
                async with client.generate(generate_request(max_tokens=400)) as s:  # refused: not ready
                    async for _ in s:
                        pass
                assert s.end.outcome == "rejected" and s.end.error.retryable
            for run in runs:
                assert run.end.outcome == "completed" and run.events == 401, (run.events, run.end)
            assert cancelled["end"].outcome == "cancelled"
            assert cancelled["took"] < 1.0 + SLACK  # one Abort attempt at most, then the end
            engine.proc.signal(signal.SIGUSR1)
            t1 = trio.current_time()
            await wait_ready(sc.http, 200, 30)
            recovered = trio.current_time() - t1
            counters = await wait_engine_idle(engine.address, timeout=60)
            assert_no_leak(counters)
            assert counters["aborts_received_by_id"].get(cancelled["id"], 0) >= 1  # the queued Abort landed
            print(
                f"Control hang: not ready after {not_ready:.1f}s; streams completed; a cancel ended in "
                f"{cancelled['took']:.2f}s; ready {recovered:.1f}s after the hang ended"
            )


async def test_generate_hang_fails_started_streams_and_probes_until_it_runs(
    aio_loop: Any, tmp_path: Path
) -> None:
    """Generate hangs (SIGUSR2; Health still READY, PINGs answered): every stream in flight
    ends ``failed`` retryable after ``--inactivity-timeout`` and is aborted (the Control service
    works: the engine releases them); the worker is not ready ("engine Generate stalled");
    a stream admitted meanwhile fails after the inactivity timeout, not the long first-event
    bound. SIGUSR2 again: the next stream completes and the worker is ready; nothing leaks."""
    with trio.fail_after(120):
        async with (
            mock_engine(tmp_path, *ENGINE_ARGS) as engine,
            sidecar(engine.address, *SIDECAR_ARGS) as sc,
            open_sidecar(sc.ws) as client,
        ):
            runs = [Run() for _ in range(8)]
            async with trio.open_nursery() as nursery:
                for run in runs:
                    nursery.start_soon(stream, client, run, 2000)
                for run in runs:
                    await run.started.wait()
                engine.proc.signal(signal.SIGUSR2)
                t0 = trio.current_time()
            failed = max(r.ended_at for r in runs) - t0
            assert failed < INACTIVITY + SLACK, failed
            for run in runs:
                assert run.end.outcome == "failed" and run.end.error.retryable, run.end
                assert f"no event from the engine for {INACTIVITY:g}s" in run.end.error.message
            reason = await wait_ready(sc.http, 503, 5)
            assert "engine Generate stalled" in reason, reason
            probe = Run()
            t1 = trio.current_time()
            await stream(client, probe, 8)
            assert probe.end.outcome == "failed" and "no first event" in probe.end.error.message
            assert trio.current_time() - t1 < INACTIVITY + SLACK
            counters = await wait_engine_idle(engine.address, timeout=30)  # aborted while hung
            assert_no_leak(counters)
            assert sum(counters["aborts_received_by_id"].values()) >= len(runs)
            engine.proc.signal(signal.SIGUSR2)
            after = Run()
            await stream(client, after, 8)
            assert after.end.outcome == "completed"
            await wait_ready(sc.http, 200, 10)
            m = await scrape(sc.http)
            assert m.value("openengine_sidecar_generate_stalls_total") == 1
            assert_no_leak(await wait_engine_idle(engine.address, timeout=30))
            print(f"Generate hang: {len(runs)} streams failed within {failed:.1f}s")
