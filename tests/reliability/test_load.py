"""1,000 concurrent streams with random cancels and abrupt disconnects against real processes:
every stream ends exactly once, nothing leaks on the engine, the sidecar's memory stays flat."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio

from tests.e2e.harness import counters_once_aborted, eventually, mock_engine, sidecar, wait_engine_idle
from tests.reliability.helpers import rss_kib, scrape
from tests.reliability.load import LoadConfig, RoundReport, run_round, summary

pytestmark = [pytest.mark.subprocess, pytest.mark.soak]

#: Every stream waits a second for its first token, so the 1,000 are in flight at once even when
#: a loaded machine takes most of a second to open them (peaks of 660 and 728 were seen without it).
ENGINE = (
    "--flavor",
    "vllm",
    "--token-delay-ms",
    "40",
    "--first-token-delay-ms",
    "1000",
    "--max-running",
    "1200",
    "--max-queue",
    "1200",
)
#: RSS growth allowed between the end of the warm-up round and the end of the last round.
FLAT_KIB = 12 * 1024


def check_round(report: RoundReport, counters: dict[str, Any], retries: float) -> None:
    """The client saw a clean protocol; the engine got an Abort for every cancelled stream,
    none for a completed one, and a second one only where the sidecar retried (an attempt
    that outlived --abort-timeout on a saturated engine is retried; Abort is idempotent)."""
    assert report.violations == [], report.violations[:10]
    assert report.other_end == {}, list(report.other_end.items())[:10]
    by_id = counters["aborts_received_by_id"]
    extra = 0
    for rid in report.completed:
        assert by_id.get(rid, 0) == 0, f"completed {rid} was aborted"
    for rid in report.cancelled:
        assert by_id.get(rid, 0) >= 1, f"cancelled {rid} was never aborted"
        extra += by_id[rid] - 1
    for rid in report.lost:
        extra += max(0, by_id.get(rid, 0) - 1)
    assert extra <= retries, (extra, retries)


async def test_thousand_concurrent_streams_with_cancels_and_disconnects(
    aio_loop: Any, tmp_path: Path
) -> None:
    cfg = LoadConfig(streams=1000, connections=8, min_tokens=3, max_tokens=10, cancel_share=0.4, seed=8)
    with trio.fail_after(80):
        async with mock_engine(tmp_path, *ENGINE) as engine, sidecar(engine.address) as sc:
            pid = sc.proc.process.pid
            rss: list[int] = [rss_kib(pid)]
            peak_active = peak_channels = 0
            reports: list[RoundReport] = []
            retried = 0.0
            for rnd in range(3):  # round 0 warms up (allocator pools, codec caches, channels)

                async def sample_active() -> None:
                    nonlocal peak_active, peak_channels
                    while True:
                        m = await scrape(sc.http)
                        peak_active = max(peak_active, int(m.value("openengine_sidecar_active_streams")))
                        channels = int(m.value("openengine_sidecar_engine_generate_channels"))
                        peak_channels = max(peak_channels, channels)
                        await trio.sleep(0.1)  # sampling another process's gauge

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(sample_active)
                    report = await run_round(sc.ws, cfg, f"r{rnd}")
                    nursery.cancel_scope.cancel()
                counters = await wait_engine_idle(engine.address, timeout=20)
                # An Abort still queued for a slot when its client got the end (at most
                # --abort-timeout later) is sent in the background; the engine can go idle
                # first (the request finished): wait for those too (bounded).
                counters = await eventually(
                    partial(counters_once_aborted, engine.address, report.cancelled), timeout=20
                )
                assert counters["requests_leaked"] == 0 and counters["orphans_expired"] == 0
                m = await scrape(sc.http)
                retries = m.value("openengine_sidecar_abort_retries_total")
                assert report.total == cfg.streams
                check_round(report, counters, retries - retried)
                retried = retries
                assert m.value("openengine_sidecar_active_streams") == 0
                assert m.value("openengine_sidecar_connections") == 0
                reports.append(report)
                rss.append(rss_kib(pid))
                print(f"round {rnd}: {summary(report)}; sidecar RSS {rss[-1]} KiB")
            total = counters
            assert total["requests_in_flight"] == 0 and total["streams_open"] == 0
            assert peak_active >= 800, peak_active  # they really were in flight at once
            # the engine (grpclib) takes 100 streams per HTTP/2 connection: the pool grew past
            # its 4 kept channels to carry them (else streams past 400 would wait in grpclib)
            assert peak_channels >= 8, peak_channels
            assert sum(len(r.cancelled) for r in reports) > 200
            assert sum(len(r.lost) for r in reports) > 0  # some connections really were dropped
            grown = rss[-1] - rss[1]
            print(
                f"peak active streams {peak_active}; RSS after warm-up {rss[1]} KiB, after {len(reports) - 1} more rounds {rss[-1]} KiB ({grown:+d} KiB)"
            )
            assert grown < FLAT_KIB, rss
