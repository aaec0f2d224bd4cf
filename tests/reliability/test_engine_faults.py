"""Engine faults, end to end (real mock-engine and sidecar processes): a stalled stream, Abort
refused or unavailable, Abort ignored. The engine's own counters are the ground truth."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from sidecar.client.sidecar_client import open_sidecar
from tests.e2e.harness import (
    engine_counters,
    eventually,
    generate_request,
    mock_engine,
    sidecar,
    wait_engine_idle,
)
from tests.reliability.helpers import scrape, stall_request

pytestmark = pytest.mark.slow


async def _stream(client: Any, request: dict[str, Any]) -> tuple[list[Any], Any, float]:
    """Run one stream to its end: (events, end, seconds from the last event to the end)."""
    events: list[Any] = []
    last = trio.current_time()
    async with client.generate(request) as s:
        async for ev in s:
            events.append(ev)
            last = trio.current_time()
    return events, s.end, trio.current_time() - last


async def test_stalled_stream_fails_on_inactivity_timeout_and_is_aborted(
    aio_loop: Any, tmp_path: Path
) -> None:
    """The engine stops sending (fault ``stall=3``): after ``--inactivity-timeout`` the stream
    ends ``failed`` (INTERNAL, retryable), the upstream is closed and exactly one Abort names
    it; the engine is left with nothing. A healthy stream beside it is not disturbed."""
    with trio.fail_after(40):
        async with (
            mock_engine(tmp_path, "--flavor", "vllm", "--token-delay-ms", "5") as engine,
            sidecar(engine.address, "--inactivity-timeout", "0.6") as sc,
            open_sidecar(sc.ws) as client,
        ):
            results: dict[str, Any] = {}

            async def one(name: str, request: dict[str, Any]) -> None:
                results[name] = await _stream(client, request)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(
                    one, "stalled", stall_request(max_tokens=50, stall_after=3, requestId="stalled")
                )
                nursery.start_soon(one, "healthy", generate_request(max_tokens=100, requestId="healthy"))
            events, end, waited = results["stalled"]
            assert end.outcome == "failed", end
            assert end.error.code == "ERROR_CODE_INTERNAL" and end.error.retryable
            assert "no event from the engine for 0.6s" in end.error.message
            assert len([e for e in events if e.response.token is not None]) == 3
            assert 0.55 <= waited < 3.0, waited
            h_events, h_end, _ = results["healthy"]
            assert h_end.outcome == "completed" and len(h_events) == 101
            counters = await wait_engine_idle(engine.address)
            assert counters["aborts_received_by_id"] == {"stalled": 1}
            assert counters["abort_outcomes"] == {"ABORTED": 1}
            assert counters["requests_leaked"] == 0 and counters["orphans_expired"] == 0
            assert counters["requests_completed"] == 1
            m = await scrape(sc.http)
            assert (
                m.value("openengine_sidecar_streams_total", outcome="failed", code="ERROR_CODE_INTERNAL") == 1
            )
            assert m.value("openengine_sidecar_aborts_total", result="aborted") == 1
            assert m.value("openengine_sidecar_active_streams") == 0


async def test_unavailable_aborts_are_retried_with_backoff_and_block_nobody(
    aio_loop: Any, tmp_path: Path
) -> None:
    """The engine drops the first 3 Aborts (UNAVAILABLE): the cancelled stream's ``end`` comes
    at once, the Abort is retried in the background with exponential backoff (50, 100, 200 ms)
    until the engine takes it, every retry is counted, and streams running meanwhile (one
    started before, one after the cancel) finish on time."""
    with trio.fail_after(40):
        async with (
            mock_engine(
                tmp_path, "--flavor", "vllm", "--token-delay-ms", "10", "--fault", "drop-aborts=3"
            ) as engine,
            sidecar(engine.address, "--abort-retry-window", "10") as sc,
            open_sidecar(sc.ws) as client,
        ):
            times: dict[str, float] = {}
            ends: dict[str, Any] = {}

            async def healthy(name: str, started: trio.Event | None = None) -> None:
                t0 = trio.current_time()
                async with client.generate(generate_request(max_tokens=40, requestId=name)) as s:
                    async for _ in s:
                        if started is not None:
                            started.set()
                ends[name], times[name] = s.end, trio.current_time() - t0

            first = trio.Event()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(healthy, "before", first)
                await first.wait()
                async with client.generate(generate_request(max_tokens=500, requestId="victim")) as s:
                    async for _ in s:
                        break
                    t_cancel = trio.current_time()
                    await s.cancel()
                    ends["victim"] = await s.wait_end()
                end_latency = trio.current_time() - t_cancel
                nursery.start_soon(healthy, "after")
            assert ends["victim"].outcome == "cancelled"
            assert end_latency < 1.0, end_latency  # not held by the retries
            for name in ("before", "after"):
                assert ends[name].outcome == "completed", ends[name]
                assert times[name] < 3.0, times  # 40 tokens x 10 ms, plus slack for a busy box

            async def engine_took_it() -> dict[str, Any] | None:
                c = await engine_counters(engine.address)
                return c if c["abort_outcomes"].get("ABORTED") == 1 else None

            counters = await eventually(engine_took_it, 10)
            retried_for = trio.current_time() - t_cancel
            assert retried_for >= 0.05 + 0.1 + 0.2, retried_for  # the backoff sleeps, at least
            assert counters["aborts_received_by_id"] == {"victim": 4}
            assert counters["abort_outcomes"] == {"DROPPED": 3, "ABORTED": 1}
            counters = await wait_engine_idle(engine.address)
            assert counters["requests_leaked"] == 0 and counters["orphans_aborted"] == 1
            m = await scrape(sc.http)
            assert m.value("openengine_sidecar_abort_retries_total") == 3
            assert m.value("openengine_sidecar_aborts_total", result="aborted") == 1
            assert m.value("openengine_sidecar_aborts_total", result="failed") == 0


async def test_abort_retries_give_up_at_the_retry_window(aio_loop: Any, tmp_path: Path) -> None:
    """An engine that never takes an Abort: retries stop at ``--abort-retry-window``, the
    failure is counted (``aborts_total{result="failed"}``), and the request stays leaked on the
    engine until the engine's own orphan timeout frees it (the sidecar cannot do more)."""
    with trio.fail_after(40):
        async with (
            mock_engine(
                tmp_path,
                "--flavor",
                "vllm",
                "--token-delay-ms",
                "10",
                "--fault",
                "drop-aborts",
                "--orphan-timeout",
                "3",
            ) as engine,
            sidecar(engine.address, "--abort-retry-window", "1") as sc,
            open_sidecar(sc.ws) as client,
        ):
            async with client.generate(generate_request(max_tokens=500, requestId="victim")) as s:
                async for _ in s:
                    break
                await s.cancel()
                assert (await s.wait_end()).outcome == "cancelled"

            async def gave_up() -> Any:
                m = await scrape(sc.http)
                return m if m.value("openengine_sidecar_aborts_total", result="failed") == 1 else None

            m = await eventually(gave_up, 10)
            retries = m.value("openengine_sidecar_abort_retries_total")
            assert 3 <= retries <= 8, retries  # 50, 100, 200, 400 ms ... within a 1 s window
            c = await engine_counters(engine.address)
            assert c["aborts_received_by_id"]["victim"] == retries + 1
            assert c["requests_leaked"] == 1  # the engine holds it: its orphan timeout must act
            c = await wait_engine_idle(engine.address, timeout=10)
            assert c["orphans_expired"] == 1 and c["requests_leaked"] == 0
            _events, end, _ = await _stream(client, generate_request(max_tokens=3))
            assert end.outcome == "completed"


async def test_engine_that_ignores_abort_is_answered_but_leaks_on_its_side(
    aio_loop: Any, tmp_path: Path
) -> None:
    """``ignore-abort``: the engine answers ABORTED but keeps the request. The sidecar's side is
    correct (upstream closed, one Abort, counted ``aborted``, no retry); the leak is the
    engine's and shows only in its counters until its orphan timeout. This is what the
    conformance suite exists to catch (documented in docs/RELIABILITY.md)."""
    with trio.fail_after(40):
        async with (
            mock_engine(
                tmp_path,
                "--flavor",
                "vllm",
                "--token-delay-ms",
                "10",
                "--fault",
                "ignore-abort",
                "--orphan-timeout",
                "2",
            ) as engine,
            sidecar(engine.address) as sc,
            open_sidecar(sc.ws) as client,
        ):
            async with client.generate(generate_request(max_tokens=500, requestId="ignored")) as s:
                async for _ in s:
                    break
                await s.cancel()
                end = await s.wait_end()
            assert end.outcome == "cancelled" and end.error is not None
            assert end.error.code == "ERROR_CODE_CANCELLED"
            c = await engine_counters(engine.address)
            assert c["aborts_received_by_id"] == {"ignored": 1}
            assert c["abort_outcomes"] == {"ABORTED": 1}
            assert c["requests_leaked"] == 1
            m = await scrape(sc.http)
            assert m.value("openengine_sidecar_aborts_total", result="aborted") == 1
            assert m.value("openengine_sidecar_abort_retries_total") == 0
            c = await wait_engine_idle(engine.address, timeout=10)
            assert c["orphans_expired"] == 1 and c["requests_leaked"] == 0
