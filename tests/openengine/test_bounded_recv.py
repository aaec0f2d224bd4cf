"""Every message from the engine over its bound is refused from its length prefix, before it
is read (sidecar/openengine/transport/grpc_framing.py: MessageReader), against a real grpclib server: unary answers,
Generate and Drain events, KV batches. What came before is delivered, the connection serves the
next call, and a message at the bound passes."""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import trio

from sidecar.openengine import pb
from sidecar.openengine.client import EngineClient, open_engine_client
from sidecar.openengine.engine_errors import EngineClientError, EngineMessageTooLarge
from sidecar.openengine.message_limits import EngineLimits
from sidecar.openengine.schema.protobuf_wire import length_delimited
from tests.openengine.fake_grpc_engine import RunningServer, tokens


@pytest.fixture
async def client(server: RunningServer) -> AsyncIterator[EngineClient]:
    async with open_engine_client(server.address) as c:
        yield c


def wrap_parse(
    monkeypatch: pytest.MonkeyPatch,
    types: tuple[type, ...],
    wrapper: Callable[[Callable[[bytes], Any], bytes], Any],
) -> None:
    """Route each message type's ``parse`` (what the client decodes with) through ``wrapper``."""
    for message_type in types:
        parse = message_type.parse  # type: ignore[attr-defined]
        monkeypatch.setattr(
            message_type, "parse", staticmethod(lambda data, parse=parse: wrapper(parse, data))
        )


def batch(seq: int, tokens: int) -> pb.SubscribeKvEventsResponse:
    stored = pb.BlockStored(
        block_hashes=[pb.KvBlockHash(value=b"\x01", encoding="uint64")], token_ids=list(range(tokens))
    )
    return pb.SubscribeKvEventsResponse(
        batch=pb.KvEventBatch(sequence_number=seq, events=[pb.KvEvent(block_stored=stored)])
    )


async def test_a_message_over_the_bound_fails_the_stream_unread(
    server: RunningServer, client: EngineClient
) -> None:
    big = batch(1, 100_000)  # ~ 300 KB on the wire
    server.engine.streams["SubscribeKvEvents"] = lambda r, md: [batch(0, 4), big, batch(2, 4)]
    got = []
    with trio.fail_after(10), pytest.raises(EngineMessageTooLarge) as too_large:
        async with client.subscribe_kv_events(
            pb.SubscribeKvEventsRequest(), max_message_bytes=64 * 1024
        ) as kv:
            async for r in kv:
                got.append(r.batch.sequence_number)
    assert got == [0]
    assert too_large.value.size == len(bytes(big)) and too_large.value.limit == 64 * 1024
    # a new stream on the same connection is not held up by what was left unread, and
    # without a bound the same messages pass
    with trio.fail_after(20):
        server.engine.streams["SubscribeKvEvents"] = lambda r, md: [batch(0, 4), batch(2, 4)]
        async with client.subscribe_kv_events(pb.SubscribeKvEventsRequest()) as kv:
            assert [r.batch.sequence_number async for r in kv] == [0, 2]
        server.engine.streams["SubscribeKvEvents"] = lambda r, md: [batch(0, 4), big, batch(2, 4)]
        async with client.subscribe_kv_events(pb.SubscribeKvEventsRequest()) as kv:
            assert [r.batch.sequence_number async for r in kv] == [0, 1, 2]
        async with client.subscribe_kv_events(
            pb.SubscribeKvEventsRequest(), max_message_bytes=len(bytes(big))
        ) as kv:
            assert [r.batch.sequence_number async for r in kv] == [0, 1, 2]  # the bound is inclusive


# --- every kind of message is bounded (the engine is trusted for content, not sizes) ---------

KIB = 1024
SMALL = EngineLimits(max_event_bytes=64 * KIB, max_answer_bytes=64 * KIB, max_kv_batch_bytes=64 * KIB)
#: unary call -> (client method, answer)
UNARY: dict[str, tuple[Callable[[EngineClient], Awaitable[Any]], Any]] = {
    "GetServerInfo": (lambda c: c.get_server_info(), pb.ServerInfo(engine_name="fake")),
    "GetModelInfo": (lambda c: c.get_model_info("m"), pb.ModelInfo(model_id="m")),
    "GetLoad": (lambda c: c.get_load(), pb.LoadInfo(instance_id="i")),
    "GetLoad (bytes)": (lambda c: c.get_load_bytes(), pb.LoadInfo(instance_id="i")),
    "Health": (lambda c: c.health(), pb.HealthResponse(state=pb.HealthState.READY)),
    "Abort": (lambda c: c.abort(pb.AbortRequest(request_id="r")), pb.AbortResponse()),
    "LoadLora": (lambda c: c.load_lora(pb.LoadLoraRequest()), pb.LoadLoraResponse()),
    "UnloadLora": (lambda c: c.unload_lora(pb.UnloadLoraRequest()), pb.UnloadLoraResponse()),
    "ListLoras": (lambda c: c.list_loras(), pb.ListLorasResponse()),
    "GetKvEventSources": (lambda c: c.get_kv_event_sources(), pb.GetKvEventSourcesResponse()),
}


def padded(message: Any, size: int) -> bytes:
    """``message`` serialized with an unknown field making it exactly ``size`` bytes (the
    fake engine's codec sends bytes as they are)."""
    data = bytes(message)
    pad = size - len(data) - 1 - 3  # key (field 15, 1 byte) + a 3-byte length
    return data + length_delimited(15, bytes(pad))


@pytest.fixture
async def small_client(server: RunningServer) -> AsyncIterator[EngineClient]:
    async with open_engine_client(server.address, limits=SMALL) as c:
        yield c


@pytest.mark.parametrize("call", list(UNARY))
async def test_every_unary_answer_over_the_bound_fails_typed_and_harms_nothing(
    server: RunningServer, small_client: EngineClient, call: str
) -> None:
    method, answer = UNARY[call]
    rpc = call.split(" ")[0]
    server.engine.unary[rpc] = lambda r: padded(answer, 64 * KIB + 1)
    with trio.fail_after(10), pytest.raises(EngineMessageTooLarge) as too_large:
        await method(small_client)
    assert (too_large.value.size, too_large.value.limit) == (64 * KIB + 1, 64 * KIB)
    assert isinstance(too_large.value, EngineClientError) and too_large.value.retryable
    # the bound is inclusive, and the control connection serves the next call as before
    server.engine.unary[rpc] = lambda r: padded(answer, 64 * KIB)
    with trio.fail_after(10):
        await method(small_client)
        assert (await small_client.health()).state == pb.HealthState.READY


async def test_a_generate_event_over_the_bound_fails_the_stream_after_what_came_before(
    server: RunningServer, small_client: EngineClient
) -> None:
    first, *rest = tokens("r", 3)
    big = pb.GenerateResponse(request_id="r", token=pb.TokenOutput(output_index=0, text="x" * 70_000))
    server.engine.streams["Generate"] = lambda r, md: [first, big, *rest]
    got = []
    with trio.fail_after(10), pytest.raises(EngineMessageTooLarge) as too_large:
        async with small_client.generate(pb.GenerateRequest(request_id="r")) as stream:
            async for ev in stream:
                got.append(ev)
    assert got == [first] and too_large.value.size == len(bytes(big))
    assert not stream.terminal_seen  # the caller aborts, as after any engine failure
    # a well-formed stream on the same pool goes on
    server.engine.streams["Generate"] = lambda r, md: tokens("s", 3)
    with trio.fail_after(10):
        async with small_client.generate(pb.GenerateRequest(request_id="s")) as stream:
            assert len([ev async for ev in stream]) == 4


async def test_a_drain_event_over_the_bound_fails_the_stream(
    server: RunningServer, small_client: EngineClient
) -> None:
    started = pb.DrainResponse(state=pb.DrainState.STARTED)
    server.engine.streams["Drain"] = lambda r, md: [padded(started, 64 * KIB + 1)]
    with trio.fail_after(10), pytest.raises(EngineMessageTooLarge):
        async with small_client.drain(pb.DrainRequest()) as stream:
            async for _ in stream:
                pass
    server.engine.streams["Drain"] = lambda r, md: [started, pb.DrainResponse(state=pb.DrainState.COMPLETE)]
    with trio.fail_after(10):
        async with small_client.drain(pb.DrainRequest()) as stream:
            assert len([ev async for ev in stream]) == 2


async def test_kv_batches_without_a_bound_of_the_caller_get_the_clients(
    server: RunningServer, small_client: EngineClient
) -> None:
    big = batch(1, 100_000)  # ~ 300 KB, over SMALL's 64 KiB
    server.engine.streams["SubscribeKvEvents"] = lambda r, md: [batch(0, 4), big]
    got = []
    with trio.fail_after(10), pytest.raises(EngineMessageTooLarge):
        async with small_client.subscribe_kv_events(pb.SubscribeKvEventsRequest()) as kv:
            async for r in kv:
                got.append(r.batch.sequence_number)
    assert got == [0]


async def test_large_messages_decode_alike_in_a_worker_thread(
    server: RunningServer, client: EngineClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over ``decode_inline_bytes`` a message is decoded off the event loop: the same result."""
    threads: list[tuple[int, bool]] = []  # (size, decoded on the main thread)

    def recording(parse: Callable[[bytes], Any], data: bytes) -> Any:
        threads.append((len(data), threading.current_thread() is threading.main_thread()))
        return parse(data)

    wrap_parse(monkeypatch, (pb.SubscribeKvEventsResponse, pb.LoadInfo), recording)
    inline = client.limits.decode_inline_bytes
    big = batch(1, 100_000)
    info = pb.LoadInfo(instance_id="x" * (2 * inline))
    assert len(bytes(big)) > inline and len(bytes(info)) > inline
    server.engine.streams["SubscribeKvEvents"] = lambda r, md: [batch(0, 4), big, batch(2, 4)]
    server.engine.unary["GetLoad"] = lambda r: info
    with trio.fail_after(20):
        async with client.subscribe_kv_events(pb.SubscribeKvEventsRequest()) as kv:
            assert [r async for r in kv] == [batch(0, 4), big, batch(2, 4)]
        assert await client.get_load() == info
    assert [(size > inline, main) for size, main in threads] == [
        (False, True),
        (True, False),
        (False, True),
        (True, False),
    ]


async def test_large_decodes_run_at_most_decode_threads_at_once(
    server: RunningServer, client: EngineClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four KV subscriptions receiving large batches at once: never more than
    ``decode_threads`` (2) decodes run in worker threads together, and each stream keeps its
    order."""
    running, most = 0, 0
    lock = threading.Lock()

    def slow(parse: Callable[[bytes], Any], data: bytes) -> Any:
        nonlocal running, most
        if threading.current_thread() is threading.main_thread():
            return parse(data)
        with lock:
            running += 1
            most = max(most, running)
        time.sleep(0.05)  # a worker thread's decode, long enough to overlap the others'
        with lock:
            running -= 1
        return parse(data)

    wrap_parse(monkeypatch, (pb.SubscribeKvEventsResponse,), slow)
    server.engine.streams["SubscribeKvEvents"] = lambda r, md: [batch(i, 20_000) for i in range(3)]
    got: dict[int, list[int]] = {}

    async def subscribe(n: int) -> None:
        async with client.subscribe_kv_events(pb.SubscribeKvEventsRequest()) as kv:
            got[n] = [r.batch.sequence_number async for r in kv]

    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            for n in range(4):
                nursery.start_soon(subscribe, n)
    assert got == {n: [0, 1, 2] for n in range(4)}
    assert most == client.limits.decode_threads == 2
