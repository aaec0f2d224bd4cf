"""Output side of one DP rank: the PUB socket, the bounded replay buffer and the replay ROUTER.

Frames on PUB: ``[topic, seq (8 bytes BE), payload]``, ``seq`` contiguous from 0 for the
socket's lifetime. The replay ROUTER answers per :mod:`sidecar.kvbridge.replay`, bounded
per :mod:`sidecar.kvbridge.replay_server`.

Idle heartbeat: after ``heartbeat`` seconds without a batch, the last batch is published again
under the next ``seq`` (and again every ``heartbeat`` seconds while idle). Applying a batch
twice in a row leaves a consumer's view unchanged (stored blocks stored again, removed ones
removed again, cleared again), and the new number shows a consumer that lost batches — to a
dropped connection, a restarted broker, a restarted relay — its gap within ``heartbeat``
seconds even on an idle engine, instead of at the engine's next cache change.

Tasks and resources: :func:`run_rank_publisher` owns the PUB socket and runs, in its own
nursery, :func:`serve_replay`, which owns the ROUTER. Both share the in-memory
:class:`ReplayBuffer` (same thread; a replay reads it as it goes out). Both close
their socket with ``linger=0`` on the way out, whatever the reason (end of input,
cancellation, error).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from functools import partial

import trio
import zmq

from sidecar.kvbridge.events import EventBatch, cleared_batch, encode_batch
from sidecar.kvbridge.metrics import RankMetrics
from sidecar.kvbridge.replay import ReplayBuffer
from sidecar.kvbridge.replay_server import ReplayLimits, serve_replay
from sidecar.kvbridge.zmqio import advertised, bind

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RankEndpoints:
    """What one rank publishes on (as bound; hosts replaced by ``advertise_host`` when set)."""

    rank: int
    publish_endpoint: str
    replay_endpoint: str | None


async def run_rank_publisher(
    ctx: zmq.Context[zmq.Socket[bytes]],
    rank: int,
    receive: trio.MemoryReceiveChannel[list[EventBatch]],
    *,
    publish_endpoint: str,
    replay_endpoint: str | None,
    topic: str,
    buffer_steps: int,
    hwm: int,
    advertise_host: str | None = None,
    replay_limits: ReplayLimits | None = None,
    heartbeat: float = 0.0,
    task_status: trio.TaskStatus[RankEndpoints] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Publish every batch from ``receive`` (lists of batches) for ``rank``; runs until the channel closes or cancel.

    Binds PUB (and the replay ROUTER) before reporting :class:`RankEndpoints`. Each batch
    gets the next sequence number and this rank as ``data_parallel_rank``. ``heartbeat`` > 0:
    the last batch again after that many idle seconds (module doc).
    """
    metrics = RankMetrics(rank)
    topic_b = topic.encode()
    buffer = ReplayBuffer(buffer_steps)
    pub = ctx.socket(zmq.PUB)
    try:
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.SNDHWM, hwm)
        bound_pub = bind(pub, publish_endpoint)
        async with trio.open_nursery() as nursery:
            bound_replay = None
            if replay_endpoint is not None:
                bound_replay = await nursery.start(
                    partial(serve_replay, limits=replay_limits),
                    ctx,
                    replay_endpoint,
                    buffer,
                    topic_b,
                    metrics,
                )
            task_status.started(
                RankEndpoints(
                    rank,
                    advertised(bound_pub, advertise_host),
                    advertised(bound_replay, advertise_host) if bound_replay else None,
                )
            )
            seq = 0
            send = pub.send_multipart
            append = buffer.append
            events_out, batches_out, lag = metrics.events_out, metrics.batches_out, metrics.lag
            last: bytes | None = None
            while True:
                group: list[EventBatch] | None = None
                idle = heartbeat if heartbeat > 0 and last is not None else math.inf
                with trio.move_on_after(idle):
                    try:
                        group = await receive.receive()
                    except trio.EndOfChannel:
                        break
                if group is None:
                    assert last is not None
                    send([topic_b, seq.to_bytes(8, "big"), last], zmq.NOBLOCK)
                    append(seq, last)
                    seq += 1
                    metrics.heartbeats.inc()
                    continue
                events = 0
                for batch in group:
                    batch.data_parallel_rank = rank
                    try:
                        payload = encode_batch(batch)
                    except Exception as err:  # cannot happen for a decoded batch; never fatal
                        log.warning(
                            "KV rank %d: batch does not encode (%s); resyncing", rank, type(err).__name__
                        )
                        metrics.decode_errors.inc()
                        batch = cleared_batch(batch.ts, rank)
                        payload = encode_batch(batch)
                    # PUB never blocks: a subscriber past its HWM loses messages and replays.
                    send([topic_b, seq.to_bytes(8, "big"), payload], zmq.NOBLOCK)
                    append(seq, payload)
                    seq += 1
                    events += len(batch.events)
                    last = payload
                events_out.inc(events)
                batches_out.inc(len(group))
                lag.set(time.time() - group[-1].ts)
            nursery.cancel_scope.cancel()
    finally:
        pub.close(linger=0)
