"""Benchmark support in the simulated engine: stamped tokens, cancel times, lean load, stream limit."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import pytest
import trio

from sidecar.bench import procs
from sidecar.mock.services import REPORT_CANCEL_TIMES
from sidecar.openengine import pb
from sidecar.openengine.client import open_engine_client
from tests.mock_engines import mock_engine_in_process
from tests.openengine.fake_grpc_engine import generate_pool
from tests.polling import eventually


def request(rid: str, max_tokens: int = 5, **mock: Any) -> pb.GenerateRequest:
    req = pb.GenerateRequest(
        request_id=rid, prompt="hello", stopping=pb.StoppingOptions(max_tokens=max_tokens, ignore_eos=True)
    )
    if mock:
        req.extra = pb.Struct.from_dict({"mock": mock})
    return req


@pytest.mark.parametrize("fast", [True, False])
async def test_stamped_tokens_carry_the_engine_send_time(aio_loop: Any, fast: bool) -> None:
    with trio.fail_after(20):
        async with mock_engine_in_process(kv_events="none", fast=fast) as eng:
            async with open_engine_client(eng.address) as client:
                before = time.time_ns()
                async with client.generate(request("s1", stamp=True)) as stream:
                    texts = [ev.token.text async for ev in stream if ev.token is not None]
                after = time.time_ns()
                async with client.generate(request("s2")) as stream:
                    plain = [ev.token.text async for ev in stream if ev.token is not None]
    assert len(texts) == 5 and all(t.isdigit() for t in texts)
    stamps = [int(t) for t in texts]
    assert before <= stamps[0] <= stamps[-1] <= after and stamps == sorted(stamps)
    assert not any(t.isdigit() for t in plain)


async def test_bad_stamp_value_is_rejected(aio_loop: Any) -> None:
    with trio.fail_after(20):
        async with mock_engine_in_process(kv_events="none") as eng, open_engine_client(eng.address) as client:
            from sidecar.openengine.engine_errors import EngineStatusError

            with pytest.raises(EngineStatusError, match="stamp"):
                async with client.generate(request("s1", stamp="yes")) as stream:
                    async for _ in stream:
                        pass


async def test_cancel_times_are_reported_on_request(aio_loop: Any) -> None:
    with trio.fail_after(20):
        async with mock_engine_in_process(kv_events="none") as eng, open_engine_client(eng.address) as client:
            # 1: the client resets the stream after the first token (engine fault stall=1 holds it)
            async with client.generate(request("gone", 50, faults=["stall=1"])) as stream:
                async for _ in stream:
                    break
            reset_at = time.time_ns() // 1000
            # 2: Abort names a stalled request
            async with client.generate(request("aborted", 50, faults=["stall=1"])) as stream:
                async for _ in stream:
                    break
                abort_at = time.time_ns() // 1000
                await client.abort(pb.AbortRequest(request_id="aborted"))
                async for _ in stream:
                    pass
            plain = await client.get_load()
            load = await client.get_load(metadata=[REPORT_CANCEL_TIMES])
            await client.abort(pb.AbortRequest(request_id="gone"))
    assert plain.attributes is not None and "cancel_seen_us" not in plain.attributes.to_dict()
    assert load.attributes is not None
    seen = load.attributes.to_dict()["cancel_seen_us"]
    assert set(seen) == {"gone", "aborted"}
    assert seen["gone"] <= reset_at + 1_000_000
    assert abort_at <= seen["aborted"] <= abort_at + 1_000_000


async def test_lean_load_has_only_scalar_counters(aio_loop: Any) -> None:
    with trio.fail_after(20):
        async with mock_engine_in_process(kv_events="none") as eng:
            full = eng.engine.load(True)
            lean = eng.engine.load(True, lean=True)
    assert full.attributes is not None and lean.attributes is not None
    f, s = full.attributes.to_dict(), lean.attributes.to_dict()
    assert "recent_requests" in f and "recent_requests" not in s
    assert not any(isinstance(v, dict) for v in s.values())
    assert s["requests_accepted"] == f["requests_accepted"] and "streams_open" in s
    assert len(bytes(lean)) < len(bytes(full))


@pytest.mark.parametrize(("limit", "loads"), [(0, [(100, 100), (50, 100)]), (1000, [(150, 1000)])])
async def test_engine_launcher_raises_the_http2_stream_limit(
    aio_loop: Any, tmp_path: Path, limit: int, loads: list[tuple[int, int]]
) -> None:
    """grpclib servers allow 100 streams per connection; the bench's launcher lifts that.

    EngineClient reads the limit the engine advertises and opens another connection when one
    is full, so all 150 streams reach the engine either way: over two connections of at most
    100 streams with grpclib's default, over one with the launcher's 1,000."""
    sock = tmp_path / "e.sock"
    argv = [sys.executable, "-m", "sidecar.bench.engine_proc", "--max-concurrent-streams", str(limit)]
    argv += [
        "--lean-load-attributes",
        "--kv-events",
        "none",
        "--listen",
        f"unix://{sock}",
        "--max-running",
        "500",
    ]
    with trio.fail_after(40):
        async with procs.spawn("engine", argv) as proc:
            address = (await proc.wait_for_line(procs.ENGINE_READY)).group(1)
            async with open_engine_client(
                address, generate_channels=1, max_streams_per_channel=1000
            ) as client:
                counters: dict[str, Any] = {}

                async def one(i: int) -> None:
                    async with client.generate(request(f"r{i}", 50, faults=["stall=1"])) as stream:
                        async for _ in stream:
                            await trio.sleep_forever()

                async def one_open() -> bool:  # the engine's own count: another process
                    return bool((await procs.engine_counters(address))["streams_open"] >= 1)

                async with trio.open_nursery() as nursery:
                    # One stream first: the pool learns the engine's limit from its SETTINGS
                    # (until then it assumes 100 per connection, as grpclib servers allow).
                    nursery.start_soon(one, 0)
                    await eventually(one_open, 20, interval=0.05)
                    for i in range(1, 150):
                        nursery.start_soon(one, i)
                    while True:  # the engine's own count, polled: another process
                        counters = await procs.engine_counters(address)
                        if counters["streams_open"] >= 150:
                            break
                        await trio.sleep(0.05)
                    await trio.sleep(0.3)
                    counters = await procs.engine_counters(address)
                    pool = generate_pool(client).loads()
                    lean = (await client.get_load()).attributes
                    nursery.cancel_scope.cancel()
    assert counters["streams_open"] == 150
    assert pool == loads
    assert "recent_requests" in counters  # the bench's own queries get the full ground truth
    assert lean is not None and "recent_requests" not in lean.to_dict()
