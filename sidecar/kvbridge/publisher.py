"""Output side of one DP rank: the PUB socket, the bounded replay buffer and the replay ROUTER.

Frames on PUB: ``[topic, seq (8 bytes BE), payload]``, ``seq`` contiguous from 0 for the
socket's lifetime. The replay ROUTER answers per :mod:`sidecar.kvbridge.replay`.

Tasks and resources: :func:`run_rank_publisher` owns the PUB socket and runs, in its own
nursery, :func:`serve_replay`, which owns the ROUTER. Both share the in-memory
:class:`ReplayBuffer` (same thread; a replay answer works on a snapshot of it). Both close
their socket with ``linger=0`` on the way out, whatever the reason (end of input,
cancellation, error).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import trio
import zmq

from sidecar.kvbridge.events import EventBatch, encode_batch
from sidecar.kvbridge.metrics import RankMetrics
from sidecar.kvbridge.replay import END_SEQ, ReplayBuffer, parse_replay_request, seq_bytes
from sidecar.kvbridge.zmqio import advertised, recv_multipart, send_multipart

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RankEndpoints:
    """What one rank publishes on (as bound; hosts replaced by ``advertise_host`` when set)."""

    rank: int
    publish_endpoint: str
    replay_endpoint: str | None


def _bind(sock: zmq.Socket, endpoint: str) -> str:
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as err:
        raise OSError(
            err.errno, f"cannot bind KV {zmq.SocketType(int(sock.type)).name} socket on {endpoint}: {err}"
        ) from err
    bound = sock.getsockopt(zmq.LAST_ENDPOINT)
    return bound.decode() if isinstance(bound, bytes) else str(bound)


async def serve_replay(
    ctx: zmq.Context,
    endpoint: str,
    buffer: ReplayBuffer,
    topic: bytes,
    metrics: RankMetrics,
    *,
    send_timeout: float = 5.0,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Bind a ROUTER on ``endpoint`` and answer replay requests from ``buffer`` until cancelled.

    Reports the bound endpoint through ``task_status``. A reply that cannot be delivered
    within ``send_timeout`` (peer gone or not reading) is abandoned: the peer times out and
    asks again. Bind failures raise ``OSError``.
    """
    router = ctx.socket(zmq.ROUTER)
    try:
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # errors instead of silent drops at the HWM
        router.setsockopt(zmq.SNDHWM, buffer.steps + 16)  # a whole buffer fits one peer's pipe
        bound = _bind(router, endpoint)
        task_status.started(bound)
        while True:
            frames = await recv_multipart(router)
            await trio.lowlevel.checkpoint()  # a flood of requests must not starve the publisher
            req = parse_replay_request(frames)
            if req is None:
                log.warning("rank %s: malformed KV replay request (%d frames)", metrics.rank, len(frames))
                if len(frames) >= 2:  # still end the exchange so the peer is not left waiting
                    envelope = frames[:2] if frames[1] == b"" else frames[:1]
                    with trio.move_on_after(send_timeout):
                        await _send_or_drop(router, [*envelope, b"", END_SEQ, b""])
                continue
            envelope, start = req
            metrics.replay_requests.inc()
            items = buffer.since(start)
            with trio.move_on_after(send_timeout) as scope:
                ok = True
                for seq, payload in items:
                    if not await _send_or_drop(router, [*envelope, topic, seq_bytes(seq), payload]):
                        ok = False
                        break
                if ok:
                    await _send_or_drop(router, [*envelope, b"", END_SEQ, b""])
            if scope.cancelled_caught:
                log.warning("rank %s: KV replay reply abandoned (peer not reading)", metrics.rank)
    finally:
        router.close(linger=0)


async def _send_or_drop(router: zmq.Socket, frames: list[bytes]) -> bool:
    try:
        await send_multipart(router, frames)
    except zmq.ZMQError as err:  # EHOSTUNREACH: the peer left
        log.info("KV replay peer unreachable: %s", err)
        return False
    return True


async def run_rank_publisher(
    ctx: zmq.Context,
    rank: int,
    receive: trio.MemoryReceiveChannel[list[EventBatch]],
    *,
    publish_endpoint: str,
    replay_endpoint: str | None,
    topic: str,
    buffer_steps: int,
    hwm: int,
    advertise_host: str | None = None,
    task_status: trio.TaskStatus[RankEndpoints] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Publish every batch from ``receive`` (lists of batches) for ``rank``; runs until the channel closes or cancel.

    Binds PUB (and the replay ROUTER) before reporting :class:`RankEndpoints`. Each batch
    gets the next sequence number and this rank as ``data_parallel_rank``.
    """
    metrics = RankMetrics(rank)
    topic_b = topic.encode()
    buffer = ReplayBuffer(buffer_steps)
    pub = ctx.socket(zmq.PUB)
    try:
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.SNDHWM, hwm)
        bound_pub = _bind(pub, publish_endpoint)
        async with trio.open_nursery() as nursery:
            bound_replay = None
            if replay_endpoint is not None:
                bound_replay = await nursery.start(
                    serve_replay, ctx, replay_endpoint, buffer, topic_b, metrics
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
            async for group in receive:
                events = 0
                for batch in group:
                    batch.data_parallel_rank = rank
                    payload = encode_batch(batch)
                    # PUB never blocks: a subscriber past its HWM loses messages and replays.
                    send([topic_b, seq.to_bytes(8, "big"), payload], zmq.NOBLOCK)
                    append(seq, payload)
                    seq += 1
                    events += len(batch.events)
                events_out.inc(events)
                batches_out.inc(len(group))
                lag.set(time.time() - group[-1].ts)
            nursery.cancel_scope.cancel()
    finally:
        pub.close(linger=0)
