"""Control end to end: Abort, leaks, Health, Drain, LoRA, GetLoad (in-process engines)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from sidecar.openengine import pb
from sidecar.openengine.engine_errors import EngineStatusError, EngineTerminalError
from tests.polling import eventually

from .helpers import (
    collect,
    counters,
    engine,
    final_usage,
    finishes,
    health_is,
    kind,
    request,
    token_ids,
    wait_for,
)

SLOW = {"token_delay_ms": 10}


async def test_abort_live_request_ends_it_cancelled(aio_loop: Any) -> None:
    async with engine(**SLOW) as (_, client):
        req = request(
            "a",
            stopping=pb.StoppingOptions(max_tokens=500, ignore_eos=True),
            sampling=pb.SamplingParams(num_sequences=2),
        )
        async with client.generate(req) as stream:
            first = await stream.__anext__()
            reply = await client.abort(pb.AbortRequest(request_id="a"))
            assert reply.status == pb.AbortStatus.ABORTED
            rest = [e async for e in stream]
        events = [first, *rest]
        done = finishes(events)
        assert sorted(done) == [0, 1] and all(f.reason == pb.FinishReason.CANCELLED for f in done.values())
        assert final_usage(events).completion_tokens == len(token_ids(events, 0)) + len(token_ids(events, 1))
        again = await client.abort(pb.AbortRequest(request_id="a"))
        assert again.status == pb.AbortStatus.ALREADY_FINISHED
        for bad, status in (
            (pb.AbortRequest(request_id="zz"), "NOT_FOUND"),
            (pb.AbortRequest(), "INVALID_ARGUMENT"),
        ):
            with pytest.raises(EngineStatusError) as info:
                await client.abort(bad)
            assert info.value.status == status
        attrs = await counters(client)
        assert attrs["requests_aborted"] == 1 and attrs["requests_completed"] == 0
        assert attrs["aborts_received"] == 4
        assert attrs["aborts_received_by_id"] == {"a": 2, "zz": 1}
        assert attrs["abort_outcomes"] == {"ABORTED": 1, "ALREADY_FINISHED": 1, "NOT_FOUND": 1, "INVALID": 1}


async def test_abort_all_and_queued(aio_loop: Any) -> None:
    async with engine(max_running=1, **SLOW) as (_, client):
        results: dict[str, list[pb.GenerateResponse]] = {}

        async def run(rid: str) -> None:
            results[rid] = await collect(client, request(rid, max_tokens=500))

        async with trio.open_nursery() as nursery:
            for rid in ("x", "y"):
                nursery.start_soon(run, rid)
            await wait_for(client, lambda a: a["requests_in_flight"] == 2)
            reply = await client.abort(pb.AbortRequest(all_requests=pb.AllRequests()))
            assert reply.status == pb.AbortStatus.ABORTED
        for rid in ("x", "y"):
            assert finishes(results[rid])[0].reason == pb.FinishReason.CANCELLED
        assert min(len(token_ids(r)) for r in results.values()) == 0  # the queued one never ran
        attrs = await counters(client)
        assert attrs["requests_aborted"] == 2 and attrs["requests_in_flight"] == 0


async def test_client_cancel_leaks_until_abort(aio_loop: Any) -> None:
    async with engine(**SLOW) as (_, client):
        async with client.generate(request("gone", max_tokens=500)) as stream:
            await stream.__anext__()
        attrs = await wait_for(client, lambda a: a["requests_leaked"] == 1)
        assert attrs["requests_cancelled_by_client"] == 1 and attrs["streams_open"] == 0
        load = await client.get_load()
        assert load.running_requests == 1 and (load.used_kv_blocks or 0) > 0
        assert (await client.abort(pb.AbortRequest(request_id="gone"))).status == pb.AbortStatus.ABORTED
        attrs = await wait_for(client, lambda a: a["requests_leaked"] == 0)
        assert attrs["orphans_aborted"] == 1 and attrs["requests_aborted"] == 0
        assert (await client.get_load()).running_requests == 0
        again = await client.abort(pb.AbortRequest(request_id="gone"))
        assert again.status == pb.AbortStatus.ALREADY_FINISHED


async def test_orphans_release_policy_and_timeout(aio_loop: Any) -> None:
    async with engine(orphans="release", **SLOW) as (_, client):
        async with client.generate(request("gone", max_tokens=500)) as stream:
            await stream.__anext__()
        attrs = await wait_for(client, lambda a: a["requests_cancelled_by_client"] == 1)
        assert attrs["requests_leaked"] == 0 and attrs["requests_in_flight"] == 0
    async with engine(orphan_timeout_s=0.1, **SLOW) as (_, client):
        async with client.generate(request("gone", max_tokens=500)) as stream:
            await stream.__anext__()
        attrs = await wait_for(client, lambda a: a["orphans_expired"] == 1)
        assert attrs["requests_leaked"] == 0


async def test_ground_truth_invariant(aio_loop: Any) -> None:
    async with engine(faults=("error-after=3",), **SLOW) as (_, client):
        with pytest.raises(EngineTerminalError):
            await collect(client, request("f"))
        async with client.generate(request("c", max_tokens=100)) as stream:
            await stream.__anext__()
        await client.abort(pb.AbortRequest(request_id="c"))
        a = await wait_for(client, lambda a: a["requests_in_flight"] == 0)
        assert a["requests_accepted"] == (
            a["requests_completed"]
            + a["requests_failed"]
            + a["requests_cancelled_by_client"]
            + a["requests_aborted"]
            + a["requests_dropped"]
        )
        assert (a["requests_failed"], a["requests_cancelled_by_client"]) == (1, 1)


async def test_health_states(aio_loop: Any) -> None:
    async with engine(faults=("slow-start=0.3",)) as (_, client):
        assert (await client.health()).state == pb.HealthState.STARTING
        with pytest.raises(EngineStatusError) as info:
            await collect(client, request())
        assert info.value.status == "UNAVAILABLE"
        await eventually(lambda: health_is(client, pb.HealthState.READY))
        await collect(client, request("ok"))
    async with engine(faults=("unhealthy",)) as (_, client):
        h = await client.health()
        assert h.state == pb.HealthState.NOT_READY
        assert any(c.name == "model" and c.state == pb.HealthState.NOT_READY for c in h.checks)
    async with engine(role="prefill") as (_, client):
        h = await client.health(pb.HealthRequest(include_inference_probe=True, role=pb.EngineRole.DECODE))
        assert h.state == pb.HealthState.NOT_READY
        names = {c.name: c.state for c in h.checks}
        assert names["role"] == pb.HealthState.NOT_READY and names["inference_probe"] == pb.HealthState.READY
        assert names["kv_connector"] == pb.HealthState.READY


async def drain_all(client: Any, req: pb.DrainRequest) -> list[pb.DrainResponse]:
    with trio.fail_after(10):
        async with client.drain(req) as stream:
            return [r async for r in stream]


async def test_drain_idle_engine(aio_loop: Any) -> None:
    async with engine() as (_, client):
        events = await drain_all(client, pb.DrainRequest(stop_accepting_new_requests=True))
        assert [e.state for e in events] == [pb.DrainState.STARTED, pb.DrainState.COMPLETE]
        assert (events[-1].in_flight_requests, events[-1].open_kv_sessions) == (0, 0)
        assert (await client.health()).state == pb.HealthState.DRAINING
        with pytest.raises(EngineStatusError) as info:
            await collect(client, request())
        assert info.value.status == "UNAVAILABLE"
        assert (await counters(client))["draining"] is True


async def test_drain_waits_for_in_flight(aio_loop: Any) -> None:
    async with engine(**SLOW) as (_, client):
        async with client.generate(
            request("a", stopping=pb.StoppingOptions(max_tokens=30, ignore_eos=True))
        ) as stream:
            await stream.__anext__()
            async with client.drain(pb.DrainRequest(stop_accepting_new_requests=True)) as drain:
                started = await drain.__anext__()
                assert started.state == pb.DrainState.STARTED and started.in_flight_requests == 1
                events = [e async for e in stream]
                assert finishes(events)[0].reason == pb.FinishReason.LENGTH
                rest = [r async for r in drain]
        assert rest[-1].state == pb.DrainState.COMPLETE and rest[-1].in_flight_requests == 0


async def test_drain_deadline_aborts(aio_loop: Any) -> None:
    async with engine(**SLOW) as (_, client):
        async with client.generate(
            request("a", stopping=pb.StoppingOptions(max_tokens=4000, ignore_eos=True))
        ) as stream:
            await stream.__anext__()
            drained = await drain_all(client, pb.DrainRequest(deadline_ms=0, abort_after_deadline=True))
            events = [e async for e in stream]
        assert drained[0].state == pb.DrainState.STARTED and drained[-1].state == pb.DrainState.COMPLETE
        assert drained[-1].in_flight_requests == 0
        assert finishes(events)[0].reason == pb.FinishReason.CANCELLED
        attrs = await counters(client)
        assert attrs["requests_aborted"] == 1 and attrs["aborts_received"] == 0
        # stop_accepting was false: new work is still accepted
        await collect(client, request("b", max_tokens=1))


async def test_drain_deadline_without_abort_reports_remaining(aio_loop: Any) -> None:
    async with (
        engine(**SLOW) as (_, client),
        client.generate(
            request("a", stopping=pb.StoppingOptions(max_tokens=4000, ignore_eos=True))
        ) as stream,
    ):
        await stream.__anext__()
        drained = await drain_all(client, pb.DrainRequest(deadline_ms=50))
        assert drained[-1].state == pb.DrainState.COMPLETE and drained[-1].in_flight_requests == 1
        await client.abort(pb.AbortRequest(request_id="a"))


async def test_drain_unimplemented_fault(aio_loop: Any) -> None:
    async with engine(faults=("no-drain",)) as (_, client):
        with pytest.raises(EngineStatusError) as info:
            await drain_all(client, pb.DrainRequest())
        assert info.value.status == "UNIMPLEMENTED"


async def test_lora_lifecycle_over_grpc(aio_loop: Any, tmp_path: Path) -> None:
    (tmp_path / "ad").mkdir()
    adapter = pb.LoraAdapter(lora_id=7, lora_name="ad", source_path=str(tmp_path / "ad"))
    async with engine() as (_, client):
        first = await client.load_lora(pb.LoadLoraRequest(adapter=adapter))
        assert first.already_loaded is False and first.adapter == adapter
        assert (await client.load_lora(pb.LoadLoraRequest(adapter=adapter))).already_loaded is True
        for bad, status in (
            (
                pb.LoadLoraRequest(
                    adapter=pb.LoraAdapter(lora_id=8, lora_name="ad", source_path=str(tmp_path))
                ),
                "ALREADY_EXISTS",
            ),
            (
                pb.LoadLoraRequest(
                    adapter=pb.LoraAdapter(lora_id=-1, lora_name="x", source_path=str(tmp_path))
                ),
                "INVALID_ARGUMENT",
            ),
        ):
            with pytest.raises(EngineStatusError) as info:
                await client.load_lora(bad)
            assert info.value.status == status
        assert (await client.list_loras()).adapters == [adapter]
        base = token_ids(await collect(client, request("b", max_tokens=10)))
        with_lora = token_ids(await collect(client, request("l", max_tokens=10, lora_name="ad")))
        assert base != with_lora
        assert (await client.unload_lora(pb.UnloadLoraRequest(lora_name="ad"))).adapter == adapter
        for call in (
            client.unload_lora(pb.UnloadLoraRequest(lora_name="ad")),
            collect(client, request("x", lora_name="ad")),
        ):
            with pytest.raises(EngineStatusError) as info:
                await call
            assert info.value.status == "NOT_FOUND"
    async with engine(enable_lora=False) as (_, client):
        for call in (client.load_lora(pb.LoadLoraRequest(adapter=adapter)), client.list_loras()):
            with pytest.raises(EngineStatusError) as info:
                await call
            assert info.value.status == "FAILED_PRECONDITION"


async def test_get_load_reports_blocks_tokens_and_ranks(aio_loop: Any) -> None:
    async with (
        engine(dp_size=2, total_kv_blocks=64, **SLOW) as (_, client),
        client.generate(
            request("a", prompt=" ba" * 40, max_tokens=500), metadata={"openengine-target-dp-rank": "1"}
        ) as s,
    ):
        await s.__anext__()
        load = await client.get_load(include_per_rank=True)
        assert (load.running_requests, load.queued_requests, load.total_kv_blocks) == (1, 0, 128)
        assert load.used_kv_blocks == 3 and load.decode_batch_size == 1
        assert (load.running_tokens or 0) >= 41 and load.waiting_tokens == 0
        r0, r1 = load.ranks
        assert (r0.running_requests, r1.running_requests) == (0, 1)
        assert (r0.used_kv_blocks, r1.used_kv_blocks) == (0, 3)
        assert (await client.get_load(include_per_rank=False)).ranks == []
        await client.abort(pb.AbortRequest(request_id="a"))
        assert kind([e async for e in s][-1]) == "finished"
