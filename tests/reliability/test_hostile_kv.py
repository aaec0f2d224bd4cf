"""Attacks on the KV event bridge of a real ``openengine-sidecar run`` process (issue 15,
finding 8; docs/SECURITY.md "KV bridge"), asserting the bounded outcome: RSS grows by at
most 64 MiB, ``/ready`` stays 200, a generate completes within 5 s, and a legitimate replay
is still answered promptly.

``pytest tests/reliability/test_hostile_kv.py -s`` prints the measured figures.
"""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest
import trio
import zmq

from tests.e2e.harness import Sidecar, eventually, generate_request, mock_engine, sidecar
from tests.reliability.helpers import Metrics, rss_kib, scrape
from tests.reliability.test_security import _completes

pytestmark = [pytest.mark.subprocess, pytest.mark.hostile]

RSS_BOUND_KIB = 64 * 1024
REPLAY_ENDPOINT = re.compile(r"rank 0: \S+ \(replay (tcp://[^)\s]+)\)")
END = b"\xff" * 8


async def _fill(sc: Sidecar, batches: int) -> None:
    """Make the engine publish about ``batches`` KV batches (block size 1: one per token).

    Distinct prompts, one request at a time: no prefix-cache hits, one batch per step."""
    from sidecar.client.sidecar_client import open_sidecar

    per_request = 2600
    for i in range(-(-batches // per_request)):
        async with (
            open_sidecar(sc.ws) as client,
            client.generate(generate_request(prompt=f"fill {i}", max_tokens=per_request)) as s,
        ):
            async for _ in s:
                pass


def _replay_all(endpoint: str, deadline: float = 60) -> tuple[float, int]:
    """A legitimate consumer (blocking, run in a thread): seconds to receive a whole replay
    from 0, and its batch count. Like real consumers, it asks again (on a new socket) when
    nothing came for 1 s."""
    import time

    ctx = zmq.Context()
    start = time.monotonic()
    try:
        while time.monotonic() - start < deadline:
            d = ctx.socket(zmq.DEALER)
            d.setsockopt(zmq.LINGER, 0)
            d.connect(endpoint)
            d.send_multipart([b"", (0).to_bytes(8, "big")])
            n = 0
            while d.poll(1000):
                if d.recv_multipart()[2] == END:
                    return time.monotonic() - start, n
                n += 1
            d.close(linger=0)
        raise AssertionError(f"no whole replay within {deadline} s")
    finally:
        ctx.destroy(linger=0)


async def test_replay_requests_that_are_never_read(tmp_path: Path) -> None:
    """Before: 100 peers, each asking 6 times (< 10 KB in all) and reading nothing, took the
    sidecar from ~55 to ~250 MiB and a legitimate replay from 0.2 to ~19 s (answers went out
    one at a time, 5 s send timeout each); a generate took 7-10 s."""
    with trio.fail_after(180):
        async with (
            mock_engine(tmp_path, "--flavor", "vllm", "--kv-block-size", "1") as engine,
            sidecar(engine.address) as sc,
        ):
            endpoint = (await sc.proc.wait_for_line(REPLAY_ENDPOINT)).group(1)
            await _fill(sc, 10_000)
            took, held = await trio.to_thread.run_sync(_replay_all, endpoint, abandon_on_cancel=True)
            assert held >= 10_000
            rss0 = rss_kib(sc.proc.pid)
            ctx = zmq.Context()
            try:
                peers, monitors = [], []  # (kept referenced: pyzmq closes a collected socket)
                for _ in range(100):
                    peer = ctx.socket(zmq.DEALER)
                    peer.setsockopt(zmq.LINGER, 0)
                    peer.setsockopt(zmq.RCVHWM, 1)
                    peer.setsockopt(zmq.RCVBUF, 4096)
                    monitors.append(peer.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED))
                    peer.connect(endpoint)
                    peers.append(peer)
                    for _ in range(6):
                        peer.send_multipart([b"", (0).to_bytes(8, "big")])
                for monitor in monitors:  # every attacker connected: its requests are on the wire
                    await trio.to_thread.run_sync(monitor.recv_multipart, abandon_on_cancel=True)
                took_during, n = await trio.to_thread.run_sync(_replay_all, endpoint, abandon_on_cancel=True)
                assert n == held
                async with httpx.AsyncClient() as client:
                    assert (await client.get(sc.http + "/ready", timeout=5)).status_code == 200
                with trio.fail_after(5):
                    await _completes(sc.ws)

                async def accounted() -> Metrics | None:  # all 600 + ours answered or dropped
                    m = await scrape(sc.http)
                    done = m.value("openengine_sidecar_kv_replay_requests_served_total") + m.value(
                        "openengine_sidecar_kv_replay_requests_dropped_total"
                    )
                    return m if done >= 600 else None

                metrics = await eventually(accounted, timeout=20)
                growth = rss_kib(sc.proc.pid) - rss0

                async def slots_freed() -> bool:  # every attacker's replay dropped as slow
                    m = await scrape(sc.http)
                    return (
                        m.value("openengine_sidecar_kv_replays_active") == 0
                        and m.value("openengine_sidecar_kv_replay_requests_dropped_total", reason="slow")
                        == 100
                    )

                await eventually(slots_freed, timeout=20)
            finally:
                ctx.destroy(linger=0)
            dropped = metrics.value("openengine_sidecar_kv_replay_requests_dropped_total")
            reasons = {
                reason: metrics.value("openengine_sidecar_kv_replay_requests_dropped_total", reason=reason)
                for reason in ("busy", "slow", "evicted", "superseded", "gone", "malformed")
            }
            print(
                f"\nreplay flood: legit replay of {held} batches {took:.2f} s before, {took_during:.2f} s"
                f" during; RSS +{growth / 1024:.1f} MiB; {dropped:.0f} requests dropped {reasons}"
            )
            assert took_during < 5
            assert growth <= RSS_BOUND_KIB
            assert dropped >= 500  # most of the 600 requests never got a slot
