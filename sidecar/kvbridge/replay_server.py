"""The replay ROUTER of one DP rank: answers replay requests from the rank's :class:`ReplayBuffer`.

Protocol: :mod:`sidecar.kvbridge.replay`. A replay covers the batches held when it was asked
for (from ``start``, or the oldest held one, up to the newest), then the end marker; if the
publisher overwrites a batch before it went out, the replay ends early (end marker sent
there: the consumer sees what it got and treats the rest as lost).

Bounded against peers that ask and never read (docs/SECURITY.md "KV bridge"):

- each peer's pipe holds at most ``hwm`` messages (``SNDHWM`` with ``ROUTER_MANDATORY``:
  a full pipe is ``EAGAIN`` for that peer only) and its connection ``socket_buffer`` bytes
  in the kernel; nothing is ever waited on: replies go out round-robin, at most ``quantum``
  per replay per round, and a replay whose peer's pipe is full is skipped, then retried
  (at the next few rounds, then after 0.5 ms doubling to ``retry_max``);
- a replay that makes no progress for ``stall_timeout`` is dropped (its peer asks again);
- at most ``max_active`` replays at once, one per peer (a peer's new request replaces its
  old one); up to as many more requests wait, in arrival order, for a slot — freed by a
  replay that ends, or taken from the one stalled longest once it has been stalled for
  ``stall_timeout / 10``; past that, requests are dropped (the peer times out and asks again);
- requests larger than 64 bytes disconnect their peer (``MAXMSGSIZE``).

Every drop is counted in ``openengine_sidecar_kv_replay_requests_dropped_total{reason}``.

Task and resources: :func:`serve_replay` owns the ROUTER (one task, never blocked on a
peer), closed with ``linger=0`` on the way out; it reads the buffer the publisher task
appends to (same thread).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import trio
import zmq

from sidecar.kvbridge.metrics import RankMetrics
from sidecar.kvbridge.replay import END_SEQ, ReplayBuffer, parse_replay_request, seq_bytes
from sidecar.kvbridge.zmqio import bind

log = logging.getLogger(__name__)

_MAX_REQUEST_BYTES = 64
_RETRY_MIN = 0.0005
_SPINS = 16
_POLLIN = zmq.POLLIN
_EVENTS = zmq.EVENTS
_NOBLOCK = zmq.NOBLOCK
_MORE = int(zmq.SNDMORE | zmq.NOBLOCK)
_LAST = int(zmq.NOBLOCK)


@dataclass(frozen=True)
class ReplayLimits:
    """Bounds of one rank's replay ROUTER (CLI: ``--kv-replay-hwm``, ``--kv-replay-max-active``,
    ``--kv-replay-stall-timeout``)."""

    hwm: int = 100
    """Messages queued per peer (libzmq pipe); memory per slow peer <= hwm x batch size."""
    socket_buffer: int = 64 * 1024
    """Kernel send buffer per peer connection (bytes; without it the kernel grows it to MiBs)."""
    max_active: int = 128
    """Replays in progress at once (one per peer); as many more may wait for a slot."""
    stall_timeout: float = 5.0
    """A replay whose peer has read nothing for this long is dropped."""
    quantum: int = 64
    """Messages sent to one replay before the next one's turn."""
    retry_max: float = 0.05
    """A replay whose peer's pipe is full is retried after 0.5 ms, doubling up to this."""


class _Replay:
    """One replay in progress: the next seq to send, the last one it covers, when it stalled
    and when to try its peer's full pipe again."""

    __slots__ = ("backoff", "end", "envelope", "next", "retry_at", "spins", "stalled_since")

    def __init__(self, envelope: list[bytes], first: int, end: int) -> None:
        self.envelope = envelope
        self.next = first
        self.end = end  # next > end: only the end marker is left
        self.stalled_since: float | None = None
        self.retry_at = 0.0
        self.backoff = 0.0
        self.spins = 0


class ReplayServer:
    """State of one ROUTER's replays; :meth:`run` is the loop (one task owns the socket)."""

    def __init__(
        self,
        router: zmq.Socket[bytes],
        buffer: ReplayBuffer,
        topic: bytes,
        metrics: RankMetrics,
        limits: ReplayLimits,
    ) -> None:
        self.router = router
        self.buffer = buffer
        self.topic = topic
        self.metrics = metrics
        self.limits = limits
        self.active: dict[bytes, _Replay] = {}
        self.waiting: dict[bytes, tuple[list[bytes], int]] = {}  # peer -> (envelope, start), FIFO
        self._evict_after = limits.stall_timeout / 10

    async def run(self) -> None:
        """Serve until cancelled."""
        router = self.router
        while True:
            now = trio.current_time()
            took = self._take_requests(now)
            sent, due = self._send_round(now)
            self._admit(now)
            self.metrics.replays_active.set(len(self.active))
            if took or sent:
                await trio.lowlevel.checkpoint()  # the publisher and everyone else run between rounds
                continue
            if int(router.getsockopt(_EVENTS)) & _POLLIN:
                continue
            # (a pipe that drains also wakes the FD, but edge-triggered: the retry time is the bound)
            with trio.move_on_after(max(0.0, due - now)):
                await trio.lowlevel.wait_readable(router.FD)

    # -- requests ---------------------------------------------------------------------------

    def _take_requests(self, now: float, limit: int = 64) -> bool:
        router = self.router
        took = 0
        while took < limit and int(router.getsockopt(_EVENTS)) & _POLLIN:
            frames = router.recv_multipart(_NOBLOCK)
            took += 1
            req = parse_replay_request(frames)
            if req is None:
                self._drop_count("malformed")
                log.debug("rank %s: malformed KV replay request (%d frames)", self.metrics.rank, len(frames))
                if len(frames) >= 2:  # still end the exchange so the peer is not left waiting
                    self._try_send([*(frames[:2] if frames[1] == b"" else frames[:1]), b"", END_SEQ, b""])
                continue
            envelope, start = req
            peer = envelope[0]
            if peer in self.active:  # a peer's new request replaces its old one, in its slot
                old = self.active.pop(peer)
                self._drop_count("superseded")
                self._start(peer, envelope, start)
                new = self.active[peer]  # asking again buys no time: the stall state carries over
                new.stalled_since, new.retry_at, new.backoff, new.spins = (
                    old.stalled_since,
                    old.retry_at,
                    old.backoff,
                    old.spins,
                )
            elif peer in self.waiting:
                self.waiting[peer] = (envelope, start)
                self._drop_count("superseded")
            elif len(self.active) < self.limits.max_active:
                self._start(peer, envelope, start)
            elif len(self.waiting) < self.limits.max_active:
                self.waiting[peer] = (envelope, start)
            else:
                self._drop_count("busy")
        return took > 0

    def _start(self, peer: bytes, envelope: list[bytes], start: int) -> None:
        oldest, newest = self.buffer.oldest, self.buffer.newest
        if oldest is None or newest is None or start > newest:
            first, end = 0, -1  # nothing to send but the end marker
        else:
            first, end = max(start, oldest), newest
        self.active[peer] = _Replay(envelope, first, end)
        self.metrics.replay_requests.inc()

    def _admit(self, now: float) -> None:
        """Start waiting requests in arrival order while there is a slot (or a stalled replay to evict)."""
        waiting = self.waiting
        while waiting and (len(self.active) < self.limits.max_active or self._evict(now)):
            peer = next(iter(waiting))
            self._start(peer, *waiting.pop(peer))

    def _evict(self, now: float) -> bool:
        """Drop the replay stalled longest (for at least ``stall_timeout / 10``) to make room."""
        since = now - self._evict_after
        stalled = [(r.stalled_since, peer) for peer, r in self.active.items() if r.stalled_since is not None]
        victim = min(stalled)[1] if stalled and min(stalled)[0] <= since else None
        if victim is None:
            return False
        del self.active[victim]
        self._drop_count("evicted")
        return True

    # -- replies ----------------------------------------------------------------------------

    def _send_round(self, now: float) -> tuple[bool, float]:
        """Give every replay that is due one turn (up to ``quantum`` messages).

        Returns whether anything went out and when the next replay is due (``inf``: none).
        """
        sent_any = False
        due = math.inf
        buffer, topic = self.buffer, self.topic
        send = self.router.send
        for peer, r in list(self.active.items()):
            if r.retry_at > now:
                due = min(due, r.retry_at)
                continue
            for _ in range(self.limits.quantum):
                seq = r.next
                payload = buffer.get(seq) if seq <= r.end else None
                try:
                    # frame by frame (int flags: cheaper than send_multipart); with ROUTER_MANDATORY
                    # a full pipe refuses the first frame, so a message goes out whole or not at all
                    for frame in r.envelope:
                        send(frame, _MORE)
                    if payload is None:  # the end marker (also when the batch was overwritten)
                        send(b"", _MORE)
                        send(END_SEQ, _MORE)
                        send(b"", _LAST)
                    else:
                        send(topic, _MORE)
                        send(seq_bytes(seq), _MORE)
                        send(payload, _LAST)
                except zmq.Again:  # this peer's pipe is full: try it again later
                    if r.stalled_since is None:
                        r.stalled_since = now
                    elif now - r.stalled_since >= self.limits.stall_timeout:
                        del self.active[peer]
                        self._drop_count("slow")
                        log.debug("rank %s: KV replay dropped (peer not reading)", self.metrics.rank)
                        break
                    if r.spins < _SPINS:  # a flowing peer's pipe drains within moments:
                        r.spins += 1  # try again after the other tasks had a turn
                        r.retry_at = now
                    else:
                        r.backoff = min(max(2 * r.backoff, _RETRY_MIN), self.limits.retry_max)
                        r.retry_at = now + r.backoff
                    due = min(due, r.retry_at)
                    break
                except zmq.ZMQError:  # EHOSTUNREACH: the peer left
                    del self.active[peer]
                    self._drop_count("gone")
                    break
                sent_any = True
                r.stalled_since = None
                r.backoff = 0.0
                r.spins = 0
                if payload is None:
                    del self.active[peer]
                    break
                r.next = seq + 1
            else:
                due = now  # used its whole turn: more to send at once
        if self.waiting and self.active:  # a stalled replay may become evictable meanwhile
            due = min(due, now + self._evict_after)
        return sent_any, due

    def _try_send(self, frames: list[bytes]) -> None:
        try:
            self.router.send_multipart(frames, _NOBLOCK)
        except zmq.ZMQError:
            pass

    def _drop_count(self, reason: str) -> None:
        self.metrics.replay_dropped(reason)


async def serve_replay(
    ctx: zmq.Context[zmq.Socket[bytes]],
    endpoint: str,
    buffer: ReplayBuffer,
    topic: bytes,
    metrics: RankMetrics,
    *,
    limits: ReplayLimits | None = None,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Bind a ROUTER on ``endpoint`` and answer replay requests from ``buffer`` until cancelled.

    Reports the bound endpoint through ``task_status``; bind failures raise ``OSError``.
    """
    limits = limits or ReplayLimits()
    router = ctx.socket(zmq.ROUTER)
    try:
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full pipe is EAGAIN (per peer), a gone peer an error
        router.setsockopt(zmq.SNDHWM, limits.hwm)
        router.setsockopt(zmq.SNDBUF, limits.socket_buffer)
        router.setsockopt(zmq.MAXMSGSIZE, _MAX_REQUEST_BYTES)
        bound = bind(router, endpoint)
        task_status.started(bound)
        await ReplayServer(router, buffer, topic, metrics, limits).run()
    finally:
        router.close(linger=0)
