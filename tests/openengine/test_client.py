"""EngineClient against a real grpclib server over loopback TCP and a Unix socket."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import trio
import trio_asyncio

from sidecar.openengine import pb
from sidecar.openengine.client import EngineClient, open_engine_client
from sidecar.openengine.engine_errors import (
    EngineConfigError,
    EngineProtocolError,
    EngineStatusError,
    EngineTerminalError,
    EngineUnavailable,
)
from tests.openengine.fake_grpc_engine import FakeGrpcEngine, Gate, RunningServer, Status, status, tokens


@pytest.fixture
async def client(server: RunningServer) -> AsyncIterator[EngineClient]:
    async with open_engine_client(server.address) as c:
        yield c


def req(request_id: str = "r1", n: int | None = None) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(num_sequences=n) if n else None
    return pb.GenerateRequest(request_id=request_id, model="m", prompt="hi", sampling=sampling)


async def wait_aio(event: Any) -> None:
    await trio_asyncio.aio_as_trio(event.wait)()


async def test_every_unary_rpc(server: RunningServer, client: EngineClient) -> None:
    with trio.fail_after(5):
        assert (await client.get_server_info()).engine_name == "fake"
        assert (await client.get_model_info("m1")).served_model_name == "m1"
        assert (await client.get_load()).running_requests == 0
        assert (await client.health()).state == pb.HealthState.READY
        abort = await client.abort(pb.AbortRequest(request_id="x"))
        assert abort.status == pb.AbortStatus.ABORTED
        adapter = pb.LoraAdapter(lora_id=7, lora_name="a", source_path="/l/a")
        assert (await client.load_lora(pb.LoadLoraRequest(adapter=adapter))).adapter == adapter
        assert (await client.unload_lora(pb.UnloadLoraRequest(lora_name="a"))).adapter.lora_name == "a"
        assert [a.lora_name for a in (await client.list_loras()).adapters] == ["a"]
        assert (await client.get_kv_event_sources()).sources == []
    routes = [s.route for s in server.engine.seen]
    assert routes == [
        "GetServerInfo",
        "GetModelInfo",
        "GetLoad",
        "Health",
        "Abort",
        "LoadLora",
        "UnloadLora",
        "ListLoras",
        "GetKvEventSources",
    ]
    assert server.engine.seen[1].request.model == "m1"
    assert server.engine.seen[2].request.include_per_rank is True


async def test_get_load_bytes_is_the_serialized_answer(server: RunningServer, client: EngineClient) -> None:
    with trio.fail_after(5):
        parsed = await client.get_load()
        data = await client.get_load_bytes(include_per_rank=False)
    assert isinstance(data, bytes) and pb.LoadInfo.parse(data) == parsed and parsed.instance_id == "i"
    assert (
        server.engine.seen[-1].route == "GetLoad" and server.engine.seen[-1].request.include_per_rank is False
    )


async def test_generate_stream_and_metadata(server: RunningServer, client: EngineClient) -> None:
    server.engine.streams["Generate"] = lambda r, md: tokens(r.request_id, 5)
    md = {"openengine-routing-key": "k1", "openengine-target-dp-rank": "1", "traceparent": "00-" + "a" * 32}
    with trio.fail_after(5):
        async with client.generate(req(), metadata=md) as stream:
            got = [ev async for ev in stream]
            assert stream.terminal_seen
    assert [e.token.text for e in got[:5]] == ["t0", "t1", "t2", "t3", "t4"]
    assert got[-1].usage.completion_tokens == 5
    seen = server.engine.seen[-1]
    assert seen.request.request_id == "r1"
    assert {k: seen.metadata[k] for k in md} == md


async def test_prefill_ready_keeps_the_engines_session_bytes(
    server: RunningServer, client: EngineClient
) -> None:
    """The KvSessionRef as the engine sent it (out of field order, a field this schema lacks):
    what a handoff relays, byte for byte; the parsed event is what the stream yields."""
    raw = b"\x20\x01" + b"\x0a\x01a" + b"\x9a\x06\x02hi"  # dp_rank before session_id, field 99
    ready = b"\x22" + bytes([len(raw) + 2]) + b"\x0a" + bytes([len(raw)]) + raw  # prefill_ready.kv_session
    server.engine.streams["Generate"] = lambda r, md: [
        bytes(pb.GenerateResponse(request_id=r.request_id, token=pb.TokenOutput(output_index=0))),
        bytes(pb.GenerateResponse(request_id=r.request_id)) + ready,
    ]
    with trio.fail_after(5):
        async with client.generate(req()) as stream:
            events = []
            async for ev in stream:
                events.append((ev, stream.kv_session_bytes))
    (token, before), (prefill, after) = events
    assert token.token is not None and before is None
    assert prefill.prefill_ready is not None and prefill.prefill_ready.kv_session.session_id == "a"
    assert after == raw and bytes(prefill.prefill_ready.kv_session) != raw
    assert stream.terminal_seen


async def test_cancel_resets_stream_within_100ms(server: RunningServer, client: EngineClient) -> None:
    gate = Gate()
    server.engine.streams["Generate"] = lambda r, md: [*tokens(r.request_id, 2)[:2], gate]
    with trio.fail_after(5):
        with trio.CancelScope() as scope:
            async with client.generate(req()) as stream:
                async for ev in stream:
                    if ev.token.text == "t1":
                        scope.cancel()
        assert not stream.terminal_seen
        seen = server.engine.seen[-1]
    with trio.fail_after(0.1):
        await wait_aio(seen.cancelled)


async def test_leaving_stream_early_resets_it(server: RunningServer, client: EngineClient) -> None:
    gate = Gate()
    server.engine.streams["Generate"] = lambda r, md: [*tokens(r.request_id, 1)[:1], gate]
    with trio.fail_after(5):
        async with client.generate(req()) as stream:
            async for _ev in stream:
                break
    with trio.fail_after(0.1):
        await wait_aio(server.engine.seen[-1].cancelled)


async def test_status_before_acceptance(server: RunningServer, client: EngineClient) -> None:
    server.engine.streams["Generate"] = lambda r, md: [status(Status.INVALID_ARGUMENT, "bad rank")]
    with trio.fail_after(5), pytest.raises(EngineStatusError) as info:
        async with client.generate(req()) as stream:
            async for _ in stream:
                pass
    err = info.value
    assert err.status == "INVALID_ARGUMENT"
    assert err.message == "bad rank"
    assert err.code == pb.ErrorCode.INVALID_ARGUMENT
    assert not err.retryable


async def test_unary_status_maps_code(server: RunningServer, client: EngineClient) -> None:
    def boom(r: Any) -> Any:
        raise status(Status.RESOURCE_EXHAUSTED, "full")

    server.engine.unary["GetLoad"] = boom
    with trio.fail_after(5), pytest.raises(EngineStatusError) as info:
        await client.get_load()
    assert info.value.code == pb.ErrorCode.OVERLOADED
    assert info.value.retryable


async def test_terminal_engine_error(server: RunningServer, client: EngineClient) -> None:
    err = pb.EngineError(code=pb.ErrorCode.KV_TRANSFER_FAILED, message="pull failed", retryable=True)
    server.engine.streams["Generate"] = lambda r, md: [
        tokens(r.request_id, 1)[0],
        pb.GenerateResponse(request_id=r.request_id, error=err),
    ]
    with trio.fail_after(5), pytest.raises(EngineTerminalError) as info:
        async with client.generate(req()) as stream:
            async for _ in stream:
                pass
    assert info.value.code == pb.ErrorCode.KV_TRANSFER_FAILED
    assert info.value.retryable
    assert info.value.event.error == err  # type: ignore[attr-defined]
    assert stream.terminal_seen


@pytest.mark.parametrize(
    ("script", "needle"),
    [
        (lambda rid: [*tokens(rid, 1), tokens(rid, 1)[0]], "after the stream's terminal"),
        (
            lambda rid: [pb.GenerateResponse(request_id="other", token=pb.TokenOutput(output_index=0))],
            "request_id",
        ),
        (
            lambda rid: [pb.GenerateResponse(request_id=rid, token=pb.TokenOutput(text="x"))],
            "without output_index",
        ),
        (lambda rid: tokens(rid, 2)[:2], "without a terminal"),
        (lambda rid: [pb.GenerateResponse(request_id=rid, usage=pb.Usage())], "no event"),
        (
            lambda rid: [
                pb.GenerateResponse(request_id=rid, token=pb.TokenOutput(output_index=0), usage=pb.Usage())
            ],
            "non-final",
        ),
    ],
)
async def test_protocol_violations(
    server: RunningServer, client: EngineClient, script: Any, needle: str
) -> None:
    server.engine.streams["Generate"] = lambda r, md: script(r.request_id)
    with trio.fail_after(5), pytest.raises(EngineProtocolError, match=needle):
        async with client.generate(req()) as stream:
            async for _ in stream:
                pass


async def test_multi_output_terminal_after_last_finish(server: RunningServer, client: EngineClient) -> None:
    def script(r: Any, md: Any) -> list[Any]:
        a, b = tokens(r.request_id, 1, index=0), tokens(r.request_id, 1, index=1)
        a[-1].usage = None
        return [a[0], b[0], a[1], b[1]]

    server.engine.streams["Generate"] = script
    with trio.fail_after(5):
        async with client.generate(req(n=2)) as stream:
            n = 0
            async for _ in stream:
                n += 1
                assert stream.terminal_seen == (n == 4)


async def test_output_index_out_of_range(server: RunningServer, client: EngineClient) -> None:
    server.engine.streams["Generate"] = lambda r, md: tokens(r.request_id, 1, index=1)
    with trio.fail_after(5), pytest.raises(EngineProtocolError, match="output_index 1"):
        async with client.generate(req()) as stream:
            async for _ in stream:
                pass


async def test_unreachable_engine(aio_loop: Any) -> None:
    with trio.fail_after(5):
        async with open_engine_client("127.0.0.1:1") as c:
            with pytest.raises(EngineUnavailable):
                await c.health()
            with pytest.raises(EngineUnavailable):
                async with c.generate(req()) as stream:
                    async for _ in stream:
                        pass


async def test_unix_socket(aio_loop: Any, tmp_path: Any) -> None:
    srv = RunningServer(FakeGrpcEngine())
    address = await srv.start(path=str(tmp_path / "engine.sock"))
    srv.engine.streams["Generate"] = lambda r, md: tokens(r.request_id, 3)
    try:
        with trio.fail_after(5):
            async with open_engine_client(address) as c:
                assert (await c.health()).state == pb.HealthState.READY
                async with c.generate(req()) as stream:
                    assert len([e async for e in stream]) == 4
    finally:
        await srv.stop()


async def test_drain_and_kv_streams(server: RunningServer, client: EngineClient) -> None:
    server.engine.streams["Drain"] = lambda r, md: [
        pb.DrainResponse(state=pb.DrainState.STARTED, in_flight_requests=2),
        pb.DrainResponse(state=pb.DrainState.IN_PROGRESS, in_flight_requests=1),
        pb.DrainResponse(state=pb.DrainState.COMPLETE, in_flight_requests=0),
    ]
    batch = pb.KvEventBatch(sequence_number=0, data_parallel_rank=0, events=[])
    err = pb.EngineError(code=pb.ErrorCode.INTERNAL, message="lost")
    server.engine.streams["SubscribeKvEvents"] = lambda r, md: [
        pb.SubscribeKvEventsResponse(batch=batch),
        pb.SubscribeKvEventsResponse(error=err),
    ]
    with trio.fail_after(5):
        async with client.drain(pb.DrainRequest(stop_accepting_new_requests=True, deadline_ms=0)) as stream:
            states = [r.state async for r in stream]
        assert states == [pb.DrainState.STARTED, pb.DrainState.IN_PROGRESS, pb.DrainState.COMPLETE]
        assert server.engine.seen[-1].request.deadline_ms == 0
        got = []
        with pytest.raises(EngineTerminalError, match="lost"):
            async with client.subscribe_kv_events(pb.SubscribeKvEventsRequest(start_sequence_number=5)) as kv:
                async for r in kv:
                    got.append(r)
        assert got == [pb.SubscribeKvEventsResponse(batch=batch)]


async def test_drain_without_complete_is_violation(server: RunningServer, client: EngineClient) -> None:
    server.engine.streams["Drain"] = lambda r, md: [pb.DrainResponse(state=pb.DrainState.STARTED)]
    with trio.fail_after(5), pytest.raises(EngineProtocolError, match="before COMPLETE"):
        async with client.drain(pb.DrainRequest()) as stream:
            async for _ in stream:
                pass


async def test_deadline_follows_trio(server: RunningServer, client: EngineClient) -> None:
    gate = Gate()
    server.engine.unary["Health"] = lambda r: gate
    with trio.fail_after(5):
        with trio.move_on_after(0.3) as scope:
            await client.health()
        assert scope.cancelled_caught
    seen = server.engine.seen[-1]
    assert seen.deadline is not None and 0 < seen.deadline <= 0.3
    gate.event.set()


async def test_control_not_blocked_by_open_streams(server: RunningServer, client: EngineClient) -> None:
    gate = Gate()
    server.engine.streams["Generate"] = lambda r, md: [gate]
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            opened = trio.Semaphore(0)

            async def hold(i: int) -> None:
                async with client.generate(req(f"r{i}")) as stream:
                    opened.release()
                    async for _ in stream:
                        pass

            for i in range(50):
                nursery.start_soon(hold, i)
            for _ in range(50):
                await opened.acquire()
            assert (await client.health()).state == pb.HealthState.READY
            nursery.cancel_scope.cancel()


async def test_reconnect_after_engine_restart(aio_loop: Any, tmp_path: Any) -> None:
    path = str(tmp_path / "e.sock")
    srv = RunningServer(FakeGrpcEngine())
    await srv.start(path=path)
    with trio.fail_after(10):
        async with open_engine_client(f"unix://{path}") as c:
            assert (await c.health()).state == pb.HealthState.READY
            await srv.stop()
            with pytest.raises(EngineUnavailable):
                await c.health()
            srv2 = RunningServer(FakeGrpcEngine())
            await srv2.start(path=path)
            try:
                assert (await c.health()).state == pb.HealthState.READY
            finally:
                await srv2.stop()


@pytest.mark.parametrize(
    "bad", ["", "localhost", "grpc://h:1", "unix://relative", "h:0", "h:99999", "http://h:1/x"]
)
async def test_bad_addresses(bad: str) -> None:
    with pytest.raises(EngineConfigError):
        async with open_engine_client(bad):
            pass
