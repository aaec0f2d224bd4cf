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
from tests.reliability.helpers import abort_socket, generate, raw_ws, scrape, stall_request

pytestmark = pytest.mark.subprocess


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


async def _streams_open(address: str) -> bool:
    return (await engine_counters(address))["streams_open"] > 0


async def test_a_request_that_reaches_the_engine_after_its_abort_is_aborted_when_confirmed(
    aio_loop: Any, tmp_path: Path
) -> None:
    """The Abort travels on the control connection, the request on its Generate connection:
    after a partition heals (retransmission) the Abort can arrive first, answered NOT_FOUND,
    and an engine that ignores stream resets then runs the request as an orphan (the soak saw
    one). Fault ``late-generate``: the request registers 0.8 s after its stream opened. The
    client cancels at once; the sidecar's NOT_FOUND for a stream the engine sent nothing on is
    confirmed 1 s later, which finds the request and aborts it: nothing leaks."""
    with trio.fail_after(40):
        async with (
            mock_engine(
                tmp_path, "--flavor", "vllm", "--fault", "late-generate=0.8", "--orphan-timeout", "60"
            ) as engine,
            sidecar(engine.address) as sc,
            open_sidecar(sc.ws) as client,
        ):
            async with client.generate(generate_request(max_tokens=500, requestId="late")) as s:
                # the stream is open on the engine, the request not yet registered (0.8 s)
                await eventually(lambda: _streams_open(engine.address), timeout=5)
                await s.cancel()
                end = await s.wait_end()
            assert end.outcome == "cancelled", end
            c = await wait_engine_idle(engine.address, timeout=10)
            assert c["requests_leaked"] == 0 and c["orphans_expired"] == 0
            assert c["orphans_aborted"] == 1  # it did run as an orphan, until the confirmation
            assert c["aborts_received_by_id"] == {"late": 2}
            assert c["abort_outcomes"] == {"NOT_FOUND": 1, "ABORTED": 1}
            m = await scrape(sc.http)
            assert m.value("openengine_sidecar_aborts_total", result="not_found") == 1
            assert m.value("openengine_sidecar_abort_confirmations_total", result="aborted") == 1


MASS_STREAMS = 2_000
MASS_CONNECTIONS = 8


async def test_mass_disconnect_aborts_everything_in_bounded_time(aio_loop: Any, tmp_path: Path) -> None:
    """PERFORMANCE.md #4 at moderate scale: 2,000 streams held by the engine (prefill never
    ends: no token traffic), then every client vanishes at once (TCP RST). The sidecar resets
    the upstream streams and Aborts every request: at most 64 Aborts in flight, each attempt
    timed from when it is sent, jittered retries. The engine (``--orphans hold``: a request
    whose client left stays held until Aborted) must end holding nothing within 15 s, with no
    Abort given up (``aborts_total{result="failed"}`` 0)."""
    with trio.fail_after(60):
        async with (
            mock_engine(
                tmp_path,
                "--first-token-delay-ms",
                "600000",
                "--max-running",
                "4096",
                "--max-queue",
                "4096",
                "--orphans",
                "hold",
            ) as engine,
            sidecar(engine.address, "--max-streams", "4096") as sc,
        ):
            per_conn = MASS_STREAMS // MASS_CONNECTIONS
            opened = 0
            all_sent = trio.Event()
            vanish = trio.Event()

            async def connection(c: int) -> None:
                nonlocal opened
                async with raw_ws(sc.ws) as (ws, sock):
                    for i in range(per_conn):
                        req = generate_request(max_tokens=16, requestId=f"mass-{c}-{i}")
                        await ws.send_message(generate(i + 1, req))
                    opened += per_conn
                    if opened == MASS_STREAMS:
                        all_sent.set()
                    await vanish.wait()
                    abort_socket(sock)
                    await sock.aclose()

            async with trio.open_nursery() as nursery:
                for c in range(MASS_CONNECTIONS):
                    nursery.start_soon(connection, c)
                await all_sent.wait()

                async def held() -> Any:
                    c = await engine_counters(engine.address)
                    return c if c["requests_accepted"] >= MASS_STREAMS else None

                before = await eventually(held, timeout=30, interval=0.2)
                assert before["requests_in_flight"] == MASS_STREAMS
                vanished_at = trio.current_time()
                vanish.set()

            async def all_aborted() -> bool:
                m = await scrape(sc.http)
                return m.value("openengine_sidecar_aborts_total") >= MASS_STREAMS

            await eventually(all_aborted, timeout=20, interval=0.1)
            aborted_in = trio.current_time() - vanished_at
            after = await wait_engine_idle(engine.address, timeout=20)
            took = trio.current_time() - vanished_at
            print(f"\n{MASS_STREAMS} clients gone at once: every Abort answered after {aborted_in:.2f}s;")
            print(f"engine seen holding nothing after {took:.2f}s")
            assert after["requests_leaked"] == 0
            counts = {k: v for k, v in after.items() if not isinstance(v, dict)}
            assert after["orphans_aborted"] + after["requests_aborted"] == MASS_STREAMS, counts
            assert took < 15.0, f"engine still held requests {took:.1f}s after the disconnect"
            m = await scrape(sc.http)
            print(f"abort retries: {m.value('openengine_sidecar_abort_retries_total'):.0f}")
            assert m.value("openengine_sidecar_aborts_total", result="failed") == 0
            assert m.value("openengine_sidecar_aborts_total") == MASS_STREAMS


@pytest.mark.parametrize("slow_checks", [1, 2])
async def test_one_slow_health_check_keeps_serving_two_in_a_row_mark_the_engine_lost(
    aio_loop: Any, tmp_path: Path, slow_checks: int
) -> None:
    """Health calls that outlive ``--call-timeout`` (fault ``slow-health=N``: the engine's next
    N Health answers take 2 s once it served a request). One is tolerated — checked again, still
    ready, nothing rejected; two in a row mark the engine lost (not ready) until it answers
    again, and then it serves as before."""
    with trio.fail_after(40):
        async with (
            mock_engine(tmp_path, "--flavor", "vllm", "--fault", f"slow-health={slow_checks}") as engine,
            sidecar(engine.address, "--call-timeout", "0.5", "--health-interval", "0.2") as sc,
            open_sidecar(sc.ws) as client,
        ):
            _, end, _ = await _stream(client, generate_request(max_tokens=3))  # arms the fault
            assert end.outcome == "completed"

            async def slow_seen() -> bool:
                m = await scrape(sc.http)
                return m.value("openengine_sidecar_health_checks_total", result="slow") >= slow_checks

            await eventually(slow_seen, 20)
            oks = (await scrape(sc.http)).value("openengine_sidecar_health_checks_total", result="ok")

            async def answered_again() -> bool:  # the engine answers in time again
                m = await scrape(sc.http)
                return m.value("openengine_sidecar_health_checks_total", result="ok") >= oks + 2

            await eventually(answered_again, 20)
            log = "\n".join(sc.proc.lines)
            assert "checking again" in log
            if slow_checks == 1:
                assert "not ready" not in log and "lost" not in log, log
            else:
                assert "not ready: engine unreachable" in log and "engine at" in log, log
                assert "is back; rediscovered" in log
            _, end, _ = await _stream(client, generate_request(max_tokens=3))
            assert end.outcome == "completed"
