"""Every fault switch the engine owns, end to end (in-process engines; crash-after also as a process)."""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio_asyncio

from sidecar.openengine import pb
from sidecar.openengine.engine_errors import (
    EngineProtocolError,
    EngineStatusError,
    EngineTerminalError,
    EngineUnavailable,
)
from sidecar.openengine.releases import SCHEMA_RELEASE
from tests.mock_engines import EngineCrashed
from tests.polling import eventually

from .helpers import collect, counters, engine, finishes, health_is, kind, request, token_ids, wait_for

LONG = pb.StoppingOptions(max_tokens=50, ignore_eos=True)


async def test_close_without_terminal(aio_loop: Any) -> None:
    async with engine(faults=("close-without-terminal=3",)) as (_, client):
        with pytest.raises(EngineProtocolError, match="without a terminal"):
            await collect(client, request(stopping=LONG))
        attrs = await wait_for(client, lambda a: a["requests_dropped"] == 1)
        assert attrs["requests_in_flight"] == 0
        assert (
            await client.abort(pb.AbortRequest(request_id="r1"))
        ).status == pb.AbortStatus.ALREADY_FINISHED


async def test_error_after_n_tokens(aio_loop: Any) -> None:
    async with engine(faults=("error-after=2",)) as (_, client):
        seen: list[pb.GenerateResponse] = []
        with pytest.raises(EngineTerminalError) as info:
            async with client.generate(request(stopping=LONG)) as stream:
                async for ev in stream:
                    seen.append(ev)
        assert [kind(e) for e in seen] == ["token", "token"]
        err = info.value
        assert err.code == pb.ErrorCode.INTERNAL and err.retryable
        assert err.event.usage is not None and err.event.usage.completion_tokens == 2  # type: ignore[attr-defined]
        assert (await counters(client))["requests_failed"] == 1


async def test_stall_then_abort(aio_loop: Any) -> None:
    async with engine(faults=("stall=2",)) as (_, client):
        async with client.generate(request(stopping=LONG)) as stream:
            got = [await stream.__anext__(), await stream.__anext__()]
            with trio.move_on_after(0.2) as idle:
                await stream.__anext__()
            assert idle.cancelled_caught, "a stalled stream sent another event"
            await client.abort(pb.AbortRequest(request_id="r1"))
            rest = [e async for e in stream]
        assert token_ids(got) and finishes(rest)[0].reason == pb.FinishReason.CANCELLED


async def test_no_usage(aio_loop: Any) -> None:
    async with engine(faults=("no-usage",)) as (_, client):
        events = await collect(client, request(max_tokens=3))
        assert kind(events[-1]) == "finished" and all(e.usage is None for e in events)


async def test_token_after_finish(aio_loop: Any) -> None:
    async with engine(faults=("token-after-finish",)) as (_, client):
        with pytest.raises(EngineProtocolError, match="after"):
            await collect(client, request(max_tokens=3))


async def test_stream_faults_per_request_via_extra(aio_loop: Any) -> None:
    async with engine() as (_, client):
        extra = pb.Struct.from_dict({"mock": {"faults": ["error-after=1"]}})
        with pytest.raises(EngineTerminalError):
            await collect(client, request(stopping=LONG, extra=extra))
        await collect(client, request("fine", max_tokens=2))


async def test_ignore_abort(aio_loop: Any) -> None:
    async with engine(faults=("ignore-abort",), token_delay_ms=2) as (_, client):
        async with client.generate(
            request(stopping=pb.StoppingOptions(max_tokens=20, ignore_eos=True))
        ) as stream:
            await stream.__anext__()
            assert (await client.abort(pb.AbortRequest(request_id="r1"))).status == pb.AbortStatus.ABORTED
            rest = [e async for e in stream]
        assert finishes(rest)[0].reason == pb.FinishReason.LENGTH
        attrs = await counters(client)
        assert attrs["aborts_received_by_id"] == {"r1": 1} and attrs["requests_completed"] == 1


async def test_drop_aborts(aio_loop: Any) -> None:
    async with engine(faults=("drop-aborts=2",), token_delay_ms=5) as (_, client):
        async with client.generate(request(stopping=LONG)) as stream:
            await stream.__anext__()
            for _ in range(2):
                with pytest.raises(EngineStatusError) as info:
                    await client.abort(pb.AbortRequest(request_id="r1"))
                assert info.value.status == "UNAVAILABLE" and info.value.retryable
            assert (await client.abort(pb.AbortRequest(request_id="r1"))).status == pb.AbortStatus.ABORTED
            [e async for e in stream]
        attrs = await counters(client)
        assert attrs["aborts_received_by_id"] == {"r1": 3}
        assert attrs["abort_outcomes"] == {"DROPPED": 2, "ABORTED": 1}
    async with engine(faults=("drop-aborts",)) as (_, client):
        for _ in range(3):
            with pytest.raises(EngineStatusError):
                await client.abort(pb.AbortRequest(all_requests=pb.AllRequests()))


@pytest.mark.parametrize(
    ("fault", "field", "value"),
    [
        ("wrong-revision", "schema_revision", 0),
        ("wrong-revision=99", "schema_revision", 99),
        ("wrong-min-client", "minimum_client_revision", 4),
        ("wrong-release", "schema_release", "main"),
        ("wrong-release=deadbeef", "schema_release", "deadbeef"),
        ("wrong-role", "engine_role", pb.EngineRole.PREFILL),
    ],
)
async def test_wrong_discovery(aio_loop: Any, fault: str, field: str, value: Any) -> None:
    async with engine(faults=(fault,)) as (_, client):
        info = await client.get_server_info()
        assert getattr(info, field) == value
        assert info.schema_release == SCHEMA_RELEASE or field == "schema_release"
        await collect(client, request(max_tokens=1))  # still behaves as --role aggregated


async def test_crash_after_in_process(aio_loop: Any) -> None:
    async with engine(faults=("crash-after=1",)) as (_, client):
        with pytest.raises((EngineStatusError, EngineUnavailable)):
            await collect(client, request(stopping=LONG))


async def test_kv_faults_reach_the_publishers(aio_loop: Any) -> None:
    faults = ("kv-gap=1", "kv-publisher-restart=5", "kv-history-lost=7", "kv-tagged-arrays")
    async with engine(faults=faults, kv_events="zmq") as (eng, _):
        pub = eng.engine.kv_events.publishers[0]
        assert (pub.faults.gap_at, pub.faults.restart_at, pub.faults.history_lost_at) == (1, 5, 7)
        assert pub.faults.tagged_arrays
    async with engine(faults=("kv-gap=1",), flavor="trtllm", kv_events="grpc") as (eng, client):
        seqs: list[int] = []
        with trio.fail_after(10):
            async with client.subscribe_kv_events(pb.SubscribeKvEventsRequest()) as sub:
                await eventually(lambda: eng.engine.kv_events.subscribers >= 1)
                for i, syllable in enumerate((" ba", " be", " bi")):
                    await collect(client, request(f"k{i}", prompt=syllable * 20, max_tokens=1))
                async for resp in sub:
                    assert resp.batch is not None
                    seqs.append(resp.batch.sequence_number)
                    if resp.batch.sequence_number >= 2:
                        break
        assert 1 not in seqs and seqs[0] == 0


async def test_unhealthy_after(aio_loop: Any) -> None:
    async with engine(faults=("unhealthy=0.1",)) as (_, client):
        assert (await client.health()).state == pb.HealthState.READY
        await eventually(lambda: health_is(client, pb.HealthState.NOT_READY))


def test_engine_crashed_is_exported() -> None:
    assert issubclass(EngineCrashed, RuntimeError)
    assert trio_asyncio is not None
