"""EngineClient's Generate pool: streams per HTTP/2 connection bounded by our cap and the peer's.

Real grpclib servers over loopback: the simulated engine (h2's default of 100 streams per
connection) and the scriptable fake engine (with a patched, smaller limit where needed).
"""

from __future__ import annotations

from typing import Any

import grpclib.protocol
import pytest
import trio
import trio_asyncio
from h2.connection import H2Connection

from sidecar.openengine import pb
from sidecar.openengine.client import EngineClient, open_engine_client
from sidecar.openengine.engine_errors import EngineUnavailable
from tests.mock_engines import mock_engine_in_process
from tests.openengine.fake_grpc_engine import FakeGrpcEngine, Gate, RunningServer, generate_pool, tokens
from tests.polling import eventually


def stalled(server: RunningServer) -> Gate:
    """Every Generate sends one token, then waits at the returned gate."""
    gate = Gate()
    server.engine.streams["Generate"] = lambda r, md: [tokens(r.request_id, 1)[0], gate]
    return gate


def req(request_id: str) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=request_id, model="m", prompt="hi")


async def hold(
    client: EngineClient,
    rid: str,
    opened: trio.Semaphore | None = None,
    *,
    task_status: Any = trio.TASK_STATUS_IGNORED,
) -> None:
    """Open a stream, take its first token, then hold it open (reading) until cancelled."""
    async with client.generate(req(rid)) as stream:
        first = True
        async for _ in stream:
            if first:
                first = False
                task_status.started()
                if opened is not None:
                    opened.release()


class Group:
    """Held streams started one after another (each has its first token when started)."""

    def __init__(self) -> None:
        self.scope = trio.CancelScope()
        self.done = trio.Event()

    async def close(self) -> None:
        """End the group's streams; returns once each has released its place in the pool."""
        self.scope.cancel()
        await self.done.wait()


async def open_group(nursery: trio.Nursery, client: EngineClient, prefix: str, n: int) -> Group:
    g = Group()

    async def run(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        try:
            with g.scope:
                async with trio.open_nursery() as inner:
                    for i in range(n):
                        await inner.start(hold, client, f"{prefix}{i}")
                    task_status.started()
                    await trio.sleep_forever()
        finally:
            g.done.set()

    await nursery.start(run)
    return g


async def test_per_channel_cap_is_respected(server: RunningServer) -> None:
    stalled(server)
    with trio.fail_after(10):
        async with open_engine_client(
            server.address,
            generate_channels=2,
            max_streams_per_channel=10,
            idle_channel_close=0,
        ) as client:
            opened = trio.Semaphore(0)
            async with trio.open_nursery() as nursery:
                for i in range(35):  # all at once: reservations made before any connection is up
                    nursery.start_soon(hold, client, f"r{i}", opened)
                for _ in range(35):
                    await opened.acquire()
                assert generate_pool(client).loads() == [(10, 10), (10, 10), (10, 10), (5, 10)]
                assert client.generate_channel_count == 4 and client.generate_stream_count == 35
                assert len(server.engine.seen) == 35
                nursery.cancel_scope.cancel()
            # every stream ended: the two extra channels were closed, the minimum stays
            assert generate_pool(client).loads() == [(0, 10), (0, 10)]
            assert len(server.transports) == 2 + 2  # four generate connections were ever made


async def test_peer_limit_below_our_cap(server: RunningServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A server advertising 5 streams per connection: 23 streams in one burst all reach it."""

    class NarrowH2Connection(H2Connection):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            if not self.config.client_side:
                self.local_settings.max_concurrent_streams = 5
                self.local_settings.acknowledge()

    monkeypatch.setattr(grpclib.protocol, "H2Connection", NarrowH2Connection)
    stalled(server)
    with trio.fail_after(10):
        async with open_engine_client(server.address, generate_channels=1, idle_channel_close=0) as client:
            opened = trio.Semaphore(0)
            async with trio.open_nursery() as nursery:
                for i in range(23):
                    nursery.start_soon(hold, client, f"r{i}", opened)
                for _ in range(23):
                    await opened.acquire()
                assert generate_pool(client).loads() == [(5, 5)] * 4 + [(3, 5)]
                assert len(server.engine.seen) == 23
                nursery.cancel_scope.cancel()
            assert generate_pool(client).loads() == [(0, 5)]


async def test_a_channel_with_a_stream_is_never_closed(server: RunningServer) -> None:
    stalled(server)
    with trio.fail_after(10):
        async with open_engine_client(
            server.address,
            generate_channels=1,
            max_streams_per_channel=3,
            idle_channel_close=0,
        ) as client:
            async with trio.open_nursery() as nursery:
                a = await open_group(nursery, client, "a", 3)
                b = await open_group(nursery, client, "b", 3)
                c = await open_group(nursery, client, "c", 2)
                assert generate_pool(client).loads() == [(3, 3), (3, 3), (2, 3)]
                await b.close()  # the middle channel drains: closed; the last one keeps its streams
                assert generate_pool(client).loads() == [(3, 3), (2, 3)]
                c_seen = [s for s in server.engine.seen if s.request.request_id.startswith("c")]
                assert not any(s.cancelled.is_set() for s in c_seen)
                # the freed room is used before a new connection is opened
                d = await open_group(nursery, client, "d", 1)
                assert generate_pool(client).loads() == [(3, 3), (3, 3)]
                await a.close()
                assert generate_pool(client).loads() == [(0, 3), (3, 3)]  # the kept channel stays
                await c.close()
                await d.close()
                assert generate_pool(client).loads() == [(0, 3)]


async def test_idle_extra_channel_closes_after_the_idle_period(server: RunningServer) -> None:
    stalled(server)
    with trio.fail_after(10):
        async with open_engine_client(
            server.address,
            generate_channels=1,
            max_streams_per_channel=2,
            idle_channel_close=0.3,
        ) as client:
            async with trio.open_nursery() as nursery:
                await open_group(nursery, client, "a", 2)
                b = await open_group(nursery, client, "b", 1)
                await b.close()
                assert client.generate_channel_count == 2  # idle, not closed yet
                # a stream arriving in the idle period keeps the channel (and its connection)
                again = await open_group(nursery, client, "c", 1)
                await trio.sleep(0.5)
                assert generate_pool(client).loads() == [(2, 2), (1, 2)]
                await again.close()
                start = trio.current_time()
                await eventually(lambda: client.generate_channel_count == 1)
                assert trio.current_time() - start >= 0.25
                nursery.cancel_scope.cancel()
            assert len(server.transports) == 2


async def test_cancel_resets_a_stream_on_an_extra_channel(server: RunningServer) -> None:
    stalled(server)
    with trio.fail_after(10):
        async with open_engine_client(
            server.address, generate_channels=1, max_streams_per_channel=1
        ) as client:
            async with trio.open_nursery() as nursery:
                await open_group(nursery, client, "a", 1)
                b = await open_group(nursery, client, "b", 1)
                assert client.generate_channel_count == 2
                b.scope.cancel()
                seen = server.engine.seen[-1]
                assert seen.request.request_id == "b0"
                with trio.fail_after(0.1):
                    await trio_asyncio.aio_as_trio(seen.cancelled.wait)()
                nursery.cancel_scope.cancel()


async def test_pool_reconnects_after_engine_restart(aio_loop: Any, tmp_path: Any) -> None:
    path = str(tmp_path / "e.sock")
    srv = RunningServer(FakeGrpcEngine())
    await srv.start(path=path)
    stalled(srv)
    with trio.fail_after(10):
        async with open_engine_client(
            f"unix://{path}",
            generate_channels=1,
            max_streams_per_channel=2,
            idle_channel_close=0,
        ) as client:
            failures: list[BaseException] = []

            async def held(rid: str, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
                try:
                    await hold(client, rid, task_status=task_status)
                except EngineUnavailable as exc:
                    failures.append(exc)

            async with trio.open_nursery() as nursery:
                for i in range(5):
                    await nursery.start(held, f"r{i}")
                assert client.generate_channel_count == 3
                await srv.stop()
            assert len(failures) == 5
            # a lost connection is forgotten; the next stream opens a new one
            assert generate_pool(client).loads() == []
            srv2 = RunningServer(FakeGrpcEngine())
            await srv2.start(path=path)
            stalled(srv2)
            try:
                async with trio.open_nursery() as nursery:
                    for i in range(3):
                        await nursery.start(held, f"s{i}")
                    assert generate_pool(client).loads() == [(2, 2), (1, 2)]
                    assert len(srv2.engine.seen) == 3
                    nursery.cancel_scope.cancel()
            finally:
                await srv2.stop()


async def test_thousand_stalled_streams_reach_a_100_stream_engine(aio_loop: Any) -> None:
    """grpclib engines allow 100 streams per connection: with 4 fixed channels only 400 of
    these reached the engine; the pool opens connections until all 1,000 have."""
    n = 1000
    with trio.fail_after(60):
        async with mock_engine_in_process(
            kv_events="none", max_running=n, max_queue=n, total_kv_blocks=40 * n
        ) as eng:
            async with open_engine_client(eng.address, idle_channel_close=0) as client:
                opened = trio.Semaphore(0)
                stall = pb.Struct.from_dict({"mock": {"faults": ["stall=1"]}})

                async def one(i: int) -> None:
                    request = pb.GenerateRequest(
                        request_id=f"r{i}",
                        prompt="hi",
                        stopping=pb.StoppingOptions(max_tokens=50, ignore_eos=True),
                        extra=stall,
                    )
                    async with client.generate(request) as stream:
                        async for _ in stream:  # the first token: the engine is running it
                            opened.release()
                            await trio.sleep_forever()

                async with trio.open_nursery() as nursery:
                    for i in range(n):
                        nursery.start_soon(one, i)
                    for _ in range(n):
                        await opened.acquire()
                    loads = generate_pool(client).loads()
                    handlers = eng.engine.counters.streams_open
                    nursery.cancel_scope.cancel()
                assert sum(load for load, _ in loads) == n
                assert all(cap == 100 and load <= cap for load, cap in loads), loads
                assert len(loads) == 10
                assert handlers == n
                # all cancelled: every extra channel drained and closed, every stream reset
                assert generate_pool(client).loads() == [(0, 100)] * 4
                await eventually(lambda: eng.engine.counters.streams_open == 0)


async def test_a_connection_remembers_no_closed_stream(server: RunningServer) -> None:
    """A connection keeps state for open streams only: after 25 ended calls, and while a 26th
    is open, one stream is known."""
    server.engine.streams["Generate"] = lambda r, md: tokens(r.request_id, 2)
    with trio.fail_after(20):
        async with open_engine_client(server.address, generate_channels=1) as client:
            for i in range(25):
                async with client.generate(req(f"r{i}")) as stream:
                    async for _ in stream:
                        pass
            (conn,) = generate_pool(client).connections()
            assert conn._h2.streams == {} and conn.calls == {}
            stalled(server)
            async with client.generate(req("r25")) as stream:
                await stream.__anext__()
                assert list(conn._h2.streams) == [51]
            assert conn._h2.streams == {}  # reset on leaving


async def test_a_connection_out_of_stream_ids_takes_no_new_stream(server: RunningServer) -> None:
    """HTTP/2 stream ids run out after 2^30 streams on a connection: the next stream goes to a
    new connection (it failed with EngineUnavailable, and so did every later one)."""
    server.engine.streams["Generate"] = lambda r, md: tokens(r.request_id, 1)
    with trio.fail_after(10):
        async with open_engine_client(server.address, generate_channels=1, idle_channel_close=0) as client:
            async with client.generate(req("r0")) as stream:
                assert len([e async for e in stream]) == 2
            (conn,) = generate_pool(client).connections()
            conn._h2.highest_outbound_stream_id = 2**31 - 1  # the last id was used
            for i in range(2):
                async with client.generate(req(f"r{i + 1}")) as stream:
                    assert len([e async for e in stream]) == 2
            assert generate_pool(client).connections() != [conn]
