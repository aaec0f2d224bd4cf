"""Network partitions, end to end: the engine in its own network namespace behind a veth pair,
its traffic black-holed with iptables DROP (tests/netns.py) — TCP connections stay open, every
packet vanishes, nothing is refused.

Engine path: HTTP/2 PINGs find the dead connections, streams end ``failed`` retryable, the
sidecar is not ready while the path is down and reconnects once it heals; the Aborts of the
failed streams wait and land; the engine's counters show nothing leaked.

KV event path (only the engine's ZMQ publisher port dropped): the bridge's ZMQ heartbeat
notices the silent connection and reconnects, and its replay (a gap at the next batch, or a
probe after silence) brings back what was published meanwhile, in order.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from sidecar.childproc import ENGINE_READY, SIDECAR_READY, loopback_run_args
from sidecar.client.sidecar_client import open_sidecar
from tests.e2e.harness import Proc, engine_counters, generate_request, spawn_argv, wait_engine_idle
from tests.kvbridge.consumer import Consumer
from tests.netns import NetnsPair, netns_pair
from tests.reliability.helpers import scrape
from tests.reliability.test_hung_engine import (
    CALL_TIMEOUT,
    HEALTH_INTERVAL,
    KEEPALIVE_TIMEOUT,
    NOT_READY_BOUND,
    SIDECAR_ARGS,
    SLACK,
    Run,
    assert_no_leak,
    stream,
    wait_ready,
)

pytestmark = [pytest.mark.subprocess, pytest.mark.netns]

ENGINE_PORT, KV_PORT = 50051, 5557
SILENCE_PROBE = 2.0
#: How long the engine path stays black-holed while cancelled streams' Aborts are owed.
PARTITION_OVER_ABORT_WINDOW = 2 * KEEPALIVE_TIMEOUT + 5.0


@asynccontextmanager
async def partitioned_pair(
    tmp_path: Path, *sidecar_args: str, engine_args: tuple[str, ...] = ()
) -> AsyncIterator[tuple[NetnsPair, Proc, str, Proc]]:
    """Namespaces, an engine in one, a sidecar in the other: (net, engine proc, engine
    address, sidecar proc)."""
    with netns_pair() as net:
        engine_address = f"{net.engine_ip}:{ENGINE_PORT}"
        engine_argv = [
            sys.executable,
            "-m",
            "sidecar",
            "mock-engine",
            "--listen",
            engine_address,
            "--kv-host",
            net.engine_ip,
            "--kv-port",
            str(KV_PORT),
            "--flavor",
            "vllm",
            "--token-delay-ms",
            "20",
            "--orphans",
            "hold",
            "--orphan-timeout",
            "300",
            *engine_args,
        ]
        sidecar_argv = [sys.executable, "-m", "sidecar", *loopback_run_args(engine_address), *sidecar_args]
        async with spawn_argv(net.argv(net.engine, engine_argv), label="mock-engine") as engine:
            await engine.wait_for_line(ENGINE_READY)
            async with spawn_argv(net.argv(net.sidecar, sidecar_argv), label="sidecar") as sc:
                await sc.wait_for_line(SIDECAR_READY)
                try:
                    yield net, engine, engine_address, sc
                finally:
                    net.heal()


def urls(sc: Proc) -> tuple[str, str]:
    m = SIDECAR_READY.search("\n".join(sc.lines))
    assert m is not None
    return m.group(1), m.group(2)


async def test_engine_partition_fails_streams_and_reconnects_when_healed(
    aio_loop: Any, tmp_path: Path
) -> None:
    with trio.fail_after(150):
        async with partitioned_pair(
            tmp_path, *SIDECAR_ARGS, "--inactivity-timeout", "60", "--abort-retry-window", "2"
        ) as (net, _engine, engine_address, sc):
            ws, http = urls(sc)
            with net.entered(net.sidecar):
                async with open_sidecar(ws) as client:
                    runs = [Run() for _ in range(12)]
                    async with trio.open_nursery() as nursery:
                        for run in runs:
                            nursery.start_soon(stream, client, run, 2000)
                        for run in runs:
                            await run.started.wait()
                        net.partition()
                        t0 = trio.current_time()
                        reason = await wait_ready(http, 503, NOT_READY_BOUND)
                        not_ready = trio.current_time() - t0
                        assert "engine unreachable" in reason, reason
                    failed = max(r.ended_at for r in runs) - t0
                    assert failed < HEALTH_INTERVAL + CALL_TIMEOUT + KEEPALIVE_TIMEOUT + SLACK, failed
                    for run in runs:
                        assert run.end.outcome == "failed" and run.end.error.retryable, run.end
                    async with client.generate(generate_request(max_tokens=4)) as refused:
                        async for _ in refused:
                            pass
                    assert refused.end.outcome == "rejected" and refused.end.error.retryable
                    assert (await scrape(http)).value(
                        "openengine_sidecar_engine_keepalive_timeouts_total"
                    ) >= 1
                    await trio.sleep(
                        3
                    )  # the partition outlasts the 2 s Abort retry window (the fault itself)
                    net.heal()
                    t1 = trio.current_time()
                    await wait_ready(http, 200, 30)
                    reconnected = trio.current_time() - t1
                    after = Run()
                    await stream(client, after, 8)
                    assert after.end.outcome == "completed"
                counters = await wait_engine_idle(engine_address, timeout=60)
                assert_no_leak(counters)
                assert sum(counters["aborts_received_by_id"].values()) >= len(runs)
                print(
                    f"engine partition: not ready after {not_ready:.1f}s, {len(runs)} streams failed within "
                    f"{failed:.1f}s; healed: ready again {reconnected:.1f}s later; leaked {counters['requests_leaked']:g}"
                )


KV_BRIDGED = re.compile(r"KV events bridged from \S+ to rank 0: (\S+) \(replay (\S+)\)")


async def test_aborts_undelivered_through_a_partition_longer_than_the_retry_window_land_after(
    aio_loop: Any, tmp_path: Path
) -> None:
    """Streams in flight when the engine's path is black-holed: the HTTP/2 PINGs close their
    connection, they end ``failed`` retryable and their Aborts are owed — but no new
    connection gets through, and the partition outlasts ``--abort-retry-window`` before the
    engine watch finds the engine lost (a slow ``--call-timeout``: two checks of 5 s), so the
    window runs out. The Aborts are kept, not given up, and re-sent once the path heals: the
    engine, which holds every orphan (``--orphans hold``, 300 s), ends with nothing leaked."""
    n = 8
    with trio.fail_after(150):
        async with partitioned_pair(
            tmp_path,
            *SIDECAR_ARGS,
            "--health-interval",
            "600",
            "--call-timeout",
            "5",
            "--inactivity-timeout",
            "600",
            "--abort-retry-window",
            "1",
        ) as (net, _engine, engine_address, sc):
            ws, http = urls(sc)
            with net.entered(net.sidecar):
                async with open_sidecar(ws) as client:
                    runs = [Run() for _ in range(n)]
                    async with trio.open_nursery() as nursery:
                        for run in runs:
                            nursery.start_soon(stream, client, run, 2000)
                        for run in runs:
                            await run.started.wait()
                        net.partition()
                        t0 = trio.current_time()
                    for run in runs:
                        assert run.end.outcome == "failed" and run.end.error.retryable, run.end
                    # the fault: it lasts past the Aborts' 1 s window (and their 1 s attempts)
                    await trio.sleep(max(0.0, PARTITION_OVER_ABORT_WINDOW - (trio.current_time() - t0)))
                    assert (await scrape(http)).value("openengine_sidecar_ready") == 1  # never found lost
                    net.heal()
                    t1 = trio.current_time()
                try:
                    counters = await wait_engine_idle(engine_address, timeout=30)
                except trio.TooSlowError:
                    raise AssertionError(  # noqa: B904 - the counters say more than the timeout
                        f"the engine still holds requests: {await engine_counters(engine_address)}"
                    )
                redelivered = trio.current_time() - t1
                assert_no_leak(counters)
                assert sum(counters["aborts_received_by_id"].values()) >= n
                m = await scrape(http)
                assert m.value("openengine_sidecar_aborts_parked_total") == n
                assert m.value("openengine_sidecar_aborts_undelivered") == 0
                assert m.value("openengine_sidecar_aborts_total", result="dropped") == 0
                print(f"{n} Aborts kept through the partition, delivered {redelivered:.1f}s after it healed")


def stored_hashes(events: list[dict[str, Any]]) -> list[Any]:
    return [h for e in events if e["type"] == "BlockStored" for h in e["block_hashes"]]


async def test_kv_event_path_partition_is_noticed_and_what_was_missed_replayed(
    aio_loop: Any, tmp_path: Path
) -> None:
    """Only the engine's KV ports are black-holed (live PUB and replay); Generate still works.
    Requests during the partition make the engine publish batches nobody receives. The
    bridge's ZMQ heartbeat drops the silent connection; once the path heals it reconnects and
    its silence probe replays the missed batches from the engine — in order, without an
    AllBlocksCleared — although the engine publishes nothing more."""
    kv_log = tmp_path / "kv-ground-truth.jsonl"
    with trio.fail_after(150):
        async with partitioned_pair(
            tmp_path,
            "--kv-heartbeat",
            "0",
            "--kv-zmq-heartbeat",
            "0.5",
            "--kv-silence-probe",
            str(SILENCE_PROBE),
            engine_args=("--kv-log", str(kv_log), "--token-delay-ms", "1"),
        ) as (net, _engine, _address, sc):
            ws, http = urls(sc)
            m = await sc.wait_for_line(KV_BRIDGED)
            publish, replay = m.group(1), m.group(2)
            with net.entered(net.sidecar):
                async with open_sidecar(ws) as client, Consumer(publish, replay) as consumer:

                    async def generate(i: int) -> None:
                        async with client.generate(generate_request(f"prompt {i} " * 40, max_tokens=2)) as s:
                            async for _ in s:
                                pass
                        assert s.end.outcome == "completed"

                    await generate(0)
                    await consumer.collect(lambda rs: bool(rs))
                    net.partition(KV_PORT, KV_PORT + 100)
                    for i in range(1, 6):
                        await generate(i)
                    await trio.sleep(4)  # the partition lasts (the fault, not a wait for state)
                    net.heal()
                    t0 = trio.current_time()
                    truth = [load for load in map(json.loads, kv_log.read_text().splitlines())]
                    want = stored_hashes([e for b in truth for e in b["events"]])

                    def complete(rs: list[Any]) -> bool:
                        return stored_hashes([e for r in rs for e in r.events]) == want

                    with trio.fail_after(SILENCE_PROBE + SLACK):  # TCP's own retransmission: ~10 s later
                        await consumer.collect(complete)
                    resynced = trio.current_time() - t0
                    events = [e for r in consumer.received for e in r.events]
                    assert not any(e["type"] == "AllBlocksCleared" for e in events)
                    assert not consumer.lost
                metrics = await scrape(http)
                assert metrics.value("openengine_sidecar_kv_silence_probes_total") >= 1
                assert metrics.value("openengine_sidecar_kv_resyncs_total") == 0
                print(
                    f"KV path partition: every missed batch published {resynced:.1f}s after the path healed"
                )
