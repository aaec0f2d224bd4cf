"""An engine's own KV event publisher class (vLLM's, SGLang's ``ZmqEventPublisher``) feeding the
bridge, and an independent consumer reading the bridge's output: the shared part of the tests
that judge the output with the engine's own decoder (tests/vllm, tests/sglang).

The engine's publisher binds ``ipc://`` endpoints in a private directory (both classes bind
those; a ``tcp`` host that is not a wildcard they would connect to instead), the bridge
subscribes to it like to any engine, and the consumer joins the bridge late, filling what it
missed from the bridge's replay. After the engine's batches the run stays idle for
``idle_heartbeats`` of the bridge's heartbeats, then asks the bridge for a replay from 0.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import msgspec
import trio

from sidecar.kvbridge import ZmqSource
from tests.kvbridge.consumer import Consumer, Published
from tests.kvbridge.helpers import Metrics, start_bridge
from tests.polling import eventually


@asynccontextmanager
async def ipc_endpoints() -> AsyncIterator[tuple[str, str]]:
    """``(publish, replay)`` ipc endpoints in a private directory, removed afterwards."""
    where = tempfile.mkdtemp(prefix="kvpub")
    try:
        yield f"ipc://{where}/pub", f"ipc://{where}/replay"
    finally:
        shutil.rmtree(where, ignore_errors=True)


@dataclass
class Run:
    engine: list[bytes]  # every payload the engine's publisher sent, in order (its own buffer)
    received: list[Published]  # what the consumer of the bridge received (live, gaps from replay)
    replayed: list[tuple[int, bytes]]  # the bridge's replay from 0, asked at the end


async def run_through_bridge(
    publisher: Any,
    make_batch: Callable[[list[Any]], Any],
    batches: list[list[Any]],
    endpoints: tuple[str, str],
    *,
    heartbeat: float = 0.3,
    idle_heartbeats: int = 3,
) -> Run:
    """Publish ``batches`` (engine event Structs) with ``publisher`` through a bridge; see the module doc.

    ``make_batch(events)`` makes the engine's batch Struct. Before the batches, empty probe
    batches go out until the bridge has taken one (a PUB drops what it sends before a
    subscription arrived; the bridge then replays the engine's history from 0 — so the
    probes, and everything after them, reach the bridge whatever the timing).
    """
    publish_ep, replay_ep = endpoints
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            m = Metrics()
            info = await start_bridge(
                nursery, [ZmqSource(0, publish_ep, "kv", replay_ep)], topic="out", heartbeat=heartbeat
            )
            (rank,) = info.ranks
            sent = 0

            def probe() -> bool:
                nonlocal sent
                if m.delta("batches_in") > 0:
                    return True
                publisher.publish(make_batch([]))
                sent += 1
                return False

            await eventually(probe, 20, interval=0.1)
            for events in batches:
                publisher.publish(make_batch(events))
                sent += 1
            await eventually(lambda: len(publisher._buffer) == sent, 20)
            engine = [payload for _, payload in list(publisher._buffer)]
            wanted = set(engine)

            def done(rs: list[Published]) -> bool:
                got = [i for i, r in enumerate(rs) if r.payload in wanted]
                return len(got) == len(engine) and len(rs) - 1 - got[-1] >= idle_heartbeats

            async with Consumer(rank.publish_endpoint, rank.replay_endpoint, b"out") as c:
                await c.collect(done)
                assert [r.seq for r in c.received] == list(range(len(c.received))) and not c.lost
                replayed = [(seq, payload) for _, seq, payload in await c.replay(0)]
            nursery.cancel_scope.cancel()
    return Run(engine, c.received, replayed)


def check_run(run: Run, decode: Callable[[bytes], Any], batches: list[list[Any]]) -> None:
    """What must hold for any engine: its payloads go out as they are, in order, each once;
    everything else the bridge sent is an idle heartbeat with no events; every payload decodes
    with the engine's own decoder (``decode``); the events a consumer applies are the ones it
    reads straight from the engine, each once; the replay is exactly what went out live."""
    engine = set(run.engine)
    out = [r.payload for r in run.received]
    assert [p for p in out if p in engine] == run.engine  # the engine's bytes, in order, once each
    heartbeats = [p for p in out if p not in engine]
    for p in heartbeats:
        hb = decode(p)
        assert hb.events == [] and hb.ts > 0
    last = max(i for i, p in enumerate(out) if p in engine)
    assert all(p not in engine for p in out[last + 1 :]) and len(out) - 1 - last >= 1
    applied = [e for p in out for e in decode(p).events]
    assert applied == [e for p in run.engine for e in decode(p).events]  # every event once, however long idle
    assert len(applied) == sum(len(b) for b in batches)
    assert run.replayed == [(r.seq, r.payload) for r in run.received]  # replay: exactly what went out live


async def engine_classes_through_bridge(kv_events: Any, batches: list[list[Any]], **rank: int) -> list[Any]:
    """``batches`` published by the engine's own ``kv_events.ZmqEventPublisher`` (``rank``: its
    data-parallel rank argument) through a bridge, judged by :func:`check_run` with the engine's
    own ``KVEventBatch`` decoder; the events a consumer of the bridge applies."""
    async with ipc_endpoints() as (publish_ep, replay_ep):
        publisher = kv_events.ZmqEventPublisher(
            **rank, endpoint=publish_ep, replay_endpoint=replay_ep, topic="kv"
        )
        try:
            run = await run_through_bridge(
                publisher,
                lambda events: kv_events.KVEventBatch(ts=time.time(), events=events),
                batches,
                (publish_ep, replay_ep),
            )
        finally:
            publisher.shutdown()
            atexit.unregister(publisher.shutdown)  # if the class registered it for exit: once is enough
    decoder = msgspec.msgpack.Decoder(kv_events.KVEventBatch)
    check_run(run, decoder.decode, batches)
    return [e for r in run.received for e in decoder.decode(r.payload).events]
