"""Output side of one DP rank: the PUB socket, the bounded replay buffer and the replay ROUTER.

Frames on PUB: ``[topic, seq (8 bytes BE), payload]``, ``seq`` contiguous from 0 for the
socket's lifetime. The replay ROUTER answers per :mod:`sidecar.kvbridge.replay`, bounded
per :mod:`sidecar.kvbridge.replay_server`.

What goes out is what the ingest made (:class:`~sidecar.kvbridge.events.OutBatch`: the
engine's payload, or one the bridge encoded): the publisher only numbers it, sends it and
keeps it for replay, so a replay returns exactly the bytes published live.

Idle heartbeat: after ``heartbeat`` seconds without a batch, a batch with no events
(``[ts, [], rank]``) is published under the next ``seq`` (again every ``heartbeat`` seconds
while idle). It changes nothing for a consumer that applies it, and its number shows a
consumer that lost batches — to a dropped connection, a restarted broker, a restarted
relay — its gap within ``heartbeat`` seconds even on an idle engine, instead of at the
engine's next cache change.

Tasks and resources: :func:`run_rank_publisher` owns the PUB socket and runs, in its own
nursery, :func:`serve_replay`, which owns the ROUTER. Both share the in-memory
:class:`ReplayBuffer` (same thread; a replay reads it as it goes out). Both close
their socket with ``linger=0`` on the way out, whatever the reason (end of input,
cancellation, error).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from functools import partial

import trio
import zmq

from sidecar.kvbridge.events import OutBatch, heartbeat_payload
from sidecar.kvbridge.metrics import RankMetrics
from sidecar.kvbridge.replay import ReplayBuffer
from sidecar.kvbridge.replay_server import ReplayLimits, serve_replay
from sidecar.kvbridge.zmqio import advertised, bind


@dataclass(frozen=True, slots=True)
class RankEndpoints:
    """What one rank publishes on (as bound; hosts replaced by ``advertise_host`` when set)."""

    rank: int
    publish_endpoint: str
    replay_endpoint: str | None


async def run_rank_publisher(
    ctx: zmq.Context[zmq.Socket[bytes]],
    rank: int,
    receive: trio.MemoryReceiveChannel[list[OutBatch]],
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
    gets the next sequence number; its payload goes out as given. ``heartbeat`` > 0: an
    empty batch after that many idle seconds, and again while idle (module doc).
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
            idle = heartbeat if heartbeat > 0 else math.inf
            while True:
                group: list[OutBatch] | None = None
                with trio.move_on_after(idle):
                    try:
                        group = await receive.receive()
                    except trio.EndOfChannel:
                        break
                if group is None:
                    payload = heartbeat_payload(time.time(), rank)
                    send([topic_b, seq.to_bytes(8, "big"), payload], zmq.NOBLOCK)
                    append(seq, payload)
                    seq += 1
                    metrics.heartbeats.inc()
                    continue
                events = 0
                for payload, n, _ts in group:
                    # PUB never blocks: a subscriber past its HWM loses messages and replays.
                    send([topic_b, seq.to_bytes(8, "big"), payload], zmq.NOBLOCK)
                    append(seq, payload)
                    seq += 1
                    events += n
                events_out.inc(events)
                batches_out.inc(len(group))
                lag.set(time.time() - group[-1].ts)
            nursery.cancel_scope.cancel()
    finally:
        pub.close(linger=0)
