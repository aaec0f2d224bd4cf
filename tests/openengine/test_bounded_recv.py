"""A server-stream message over the caller's bound is refused from its length prefix, before
it is read (sidecar/openengine/bounded_recv.py), against a real grpclib server; the stream
before it is delivered, and the same stream unbounded is unaffected."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import trio

from sidecar.openengine import pb
from sidecar.openengine.client import EngineClient, open_engine_client
from sidecar.openengine.errors import EngineMessageTooLarge
from tests.openengine.fake_engine import RunningServer


@pytest.fixture
async def client(server: RunningServer) -> AsyncIterator[EngineClient]:
    async with open_engine_client(server.address) as c:
        yield c


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
