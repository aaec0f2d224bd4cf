"""Ingest of one engine ZMQ publisher (one DP rank): SUB for live batches, DEALER for replay.

Resources: the task owns its SUB socket (with a monitor socket and a child task watching it
for a dropped connection, then replaced) and, once a replay is needed, its DEALER; all are
closed with ``linger=0`` in ``finally``. Both data sockets refuse messages over
``IngestLimits.max_batch_bytes`` (libzmq drops that connection for good: hence the watch). The DEALER is replaced after a failed replay so a
late answer can never be mistaken for the next one. The task never waits on two sockets
at once: during a replay the SUB keeps queueing in libzmq (up to its HWM; anything dropped
there shows up as a gap afterwards and is replayed in turn).

Each wake-up takes every queued message (up to ``drain_limit``) and hands their batches to
the publisher as one list: one channel hop and one scheduler round per group, not per batch.
A batch goes out as the engine's payload itself (validated by decoding; only its rank slot
set, :func:`~sidecar.kvbridge.events.published_payload`); an ``AllBlocksCleared`` the bridge
adds takes the form of the source's events.

Silent connections. A partitioned network path (packets dropped, nothing refused) leaves the
SUB's TCP connection open, and whatever the engine publishes meanwhile arrives, if at all,
when TCP's retransmission backoff next tries. So the SUB runs ZMTP heartbeats
(``zmq_heartbeat``): a connection without an answer for three intervals is dropped and made
again (``ZMQ_CONNECT_TIMEOUT`` bounds each attempt), and after ``silence_probe`` seconds
without a batch the ingest asks the replay endpoint for what follows the last batch it has
— a gap the next live batch would reveal is closed even if the engine publishes nothing more.
A probe that fails changes nothing (nothing is known to be missing); one that returns batches
is handled exactly like live ones (a hole in them is a gap, replayed or cleared as usual).

Cancellation: cancel the surrounding scope; there is nothing to flush.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import trio
import zmq

from sidecar.kvbridge.decode_msgpack import MsgpackBatchDecoder
from sidecar.kvbridge.errors import KvDecodeError
from sidecar.kvbridge.events import OutBatch, cleared_payload, published_payload
from sidecar.kvbridge.ingest_limits import IngestLimits
from sidecar.kvbridge.metrics import RankMetrics
from sidecar.kvbridge.replay import parse_upstream_reply, seq_bytes
from sidecar.kvbridge.sequencer import Action, Clear, Duplicate, Emit, Reason, Replay, ZmqSequencer
from sidecar.kvbridge.sources import ZmqSource
from sidecar.kvbridge.spans import KvSpans
from sidecar.kvbridge.zmqio import recv_multipart, recv_some
from sidecar.quoting import clip

if TYPE_CHECKING:
    from sidecar.tracing.otel import Tracer

log = logging.getLogger(__name__)


class ZmqIngest:
    """State of one ZMQ ingest task; :meth:`run` is the task."""

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        source: ZmqSource,
        out: trio.MemorySendChannel[list[OutBatch]],
        *,
        hwm: int = 100_000,
        replay_timeout: float = 5.0,
        limits: IngestLimits | None = None,
        drain_limit: int = 64,
        cleared: bool = False,
        zmq_heartbeat: float = 0.0,
        silence_probe: float = 0.0,
        tracer: Tracer | None = None,
    ) -> None:
        self.ctx = ctx
        self.source = source
        self.out = out
        self.hwm = source.hwm or hwm
        self.replay_timeout = replay_timeout
        self.limits = limits or IngestLimits()
        self.drain_limit = drain_limit
        self.zmq_heartbeat = zmq_heartbeat
        self.silence_probe = silence_probe
        self.metrics = RankMetrics(source.rank)
        self.spans = KvSpans(tracer, source.rank, "zmq")
        self.sequencer: ZmqSequencer[bytes] = ZmqSequencer(
            can_replay=source.replay_endpoint is not None, cleared=cleared
        )
        self.decoder = MsgpackBatchDecoder()
        self._dealer: zmq.Socket[bytes] | None = None
        self._rank_warned = False
        self.over_limit = False  # the last replay was abandoned at a limit
        self._dropped = False  # the current SUB connection was dropped
        self._waiting: trio.CancelScope | None = None  # the receive loop's wait, while it waits
        self._in_events = 0  # decoded since the last flush (metrics are updated per group)
        self._in_batches = 0

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Connect, then forward every batch to ``out`` until cancelled (or ``out`` is closed).

        A connection libzmq gives up on (it does after a message over ``MAXMSGSIZE``) is
        replaced by a new SUB socket; what was missed meanwhile shows up as a gap.
        """
        src = self.source
        log.info(
            "KV rank %d: subscribing to %s (replay %s)", src.rank, src.endpoint, src.replay_endpoint or "none"
        )
        started = False
        try:
            while True:
                sub = self.ctx.socket(zmq.SUB)
                monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
                try:
                    sub.setsockopt(zmq.LINGER, 0)
                    sub.setsockopt(zmq.RCVHWM, self.hwm)
                    sub.setsockopt(zmq.MAXMSGSIZE, self.limits.max_batch_bytes)
                    sub.setsockopt(zmq.SUBSCRIBE, src.topic.encode())
                    if self.zmq_heartbeat > 0:
                        ivl = max(1, int(self.zmq_heartbeat * 1000))
                        sub.setsockopt(zmq.HEARTBEAT_IVL, ivl)
                        sub.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3 * ivl)
                        sub.setsockopt(zmq.HEARTBEAT_TTL, 3 * ivl)
                        sub.setsockopt(zmq.CONNECT_TIMEOUT, 3 * ivl)
                    sub.connect(src.endpoint)
                    if not started:
                        task_status.started()
                        started = True
                    async with trio.open_nursery() as nursery:
                        self._dropped = False
                        nursery.start_soon(self._watch_disconnect, monitor)
                        await self._receive(sub)
                        nursery.cancel_scope.cancel()
                finally:
                    sub.disable_monitor()
                    monitor.close(linger=0)
                    sub.close(linger=0)
                log.warning("KV rank %d: connection to %s dropped; reconnecting", src.rank, src.endpoint)
        finally:
            self._close_dealer()

    def cleared(self, actions: Sequence[Action[bytes]] = ()) -> OutBatch:
        """An ``AllBlocksCleared`` batch for this rank, in the form of the source's events.

        Before any batch with events was decoded, the form is learned from the first batch
        among ``actions`` that decodes (the map form when none does).
        """
        decoder = self.decoder
        if decoder.form is None:
            for a in actions:
                if type(a) is Emit:
                    try:
                        decoder.decode(a.payload)
                    except KvDecodeError:
                        continue
                    if decoder.form is not None:
                        break
        now = time.time()
        return OutBatch(cleared_payload(now, self.source.rank, decoder.form or "map"), 1, now)

    async def _watch_disconnect(self, monitor: zmq.Socket[bytes]) -> None:
        """Mark the SUB's connection dropped (and end the receive loop's wait, a safe point)."""
        await recv_multipart(monitor)
        self._dropped = True
        if self._waiting is not None:
            self._waiting.cancel()

    async def _receive(self, sub: zmq.Socket[bytes]) -> None:
        """Forward live batches from ``sub`` until its connection drops."""
        src = self.source
        m = self.metrics
        seqr = self.sequencer
        silence = self.silence_probe if self.silence_probe > 0 and src.replay_endpoint else math.inf
        while not self._dropped:
            out: list[OutBatch] = []
            received: list[list[bytes]] = []  # stays empty when the wait ends by a drop
            with trio.CancelScope() as self._waiting, trio.move_on_after(silence) as quiet:
                received = await recv_some(sub, self.drain_limit)
            self._waiting = None
            if quiet.cancelled_caught:
                await self._probe()
                continue
            for frames in received:
                if len(frames) != 3 or len(frames[1]) != 8:
                    m.decode_errors.inc()
                    log.warning("KV rank %d: malformed message with %d frames ignored", src.rank, len(frames))
                    continue
                out = await self._apply(seqr.on_live(int.from_bytes(frames[1], "big"), frames[2]), out)
            if out:
                await self._flush(out)
            else:  # nothing to hand on (duplicates, malformed): still let others run
                await trio.lowlevel.checkpoint()

    async def _probe(self) -> None:
        """After silence: replay what follows the last batch (module doc)."""
        seqr = self.sequencer
        if seqr.next_seq is None:
            return  # nothing received yet: the first live batch will tell
        self.metrics.silence_probes.inc()
        self.over_limit = False
        items = await self._replay(seqr.next_seq)
        if not items:
            return  # failed (nothing known to be missing) or nothing new
        log.info(
            "KV rank %d: %d batch(es) published during a silence, replayed", self.source.rank, len(items)
        )
        out = await self._apply(seqr.on_probe(items), [])
        if out:
            await self._flush(out)

    async def _flush(self, out: list[OutBatch]) -> None:
        if self._in_batches:
            self.metrics.events_in.inc(self._in_events)
            self.metrics.batches_in.inc(self._in_batches)
            self._in_events = self._in_batches = 0
        step = self.drain_limit  # a long replay goes out in groups, so the publisher interleaves
        for i in range(0, len(out), step):
            await self.out.send(out[i : i + step] if len(out) > step else out)

    def _close_dealer(self) -> None:
        if self._dealer is not None:
            self._dealer.close(linger=0)
            self._dealer = None

    async def _apply(self, actions: list[Action[bytes]], out: list[OutBatch]) -> list[OutBatch]:
        """Carry out ``actions``, collecting output in ``out``; returns the list to keep collecting in."""
        m = self.metrics
        rank = self.source.rank
        for a in actions:
            if type(a) is Emit:
                try:
                    batch = self.decoder.decode(a.payload)
                except KvDecodeError as err:
                    m.decode_errors.inc()
                    log.warning(
                        "KV rank %d: batch %d does not decode (%s); resyncing",
                        rank,
                        a.seq,
                        clip(str(err), 200),
                    )
                    out = await self._apply(self.sequencer.clear(Reason.DECODE_ERROR), out)
                    continue
                payload_rank = batch.data_parallel_rank
                if payload_rank not in (None, rank) and not self._rank_warned:
                    self._rank_warned = True
                    log.warning("KV rank %d: engine labels its batches rank %s", rank, payload_rank)
                n = len(batch.events)
                self._in_batches += 1
                self._in_events += n
                out.append(OutBatch(published_payload(a.payload, payload_rank, rank), n, batch.ts))
            elif type(a) is Duplicate:
                m.duplicates.inc()
            elif type(a) is Clear:
                m.resync(a.reason)
                self.spans.resync(a.reason)
                log.warning("KV rank %d: publishing AllBlocksCleared (%s)", rank, a.reason)
                out.append(self.cleared(actions))
            elif type(a) is Replay:
                await self._flush(out)  # what came before the gap goes out first
                out = []
                if a.missing:
                    m.gaps.inc()
                    log.info("KV rank %d: gap of %d batches, replaying from %d", rank, a.missing, a.start)
                self.over_limit = False
                span = self.spans.replay(a.start, a.missing)
                items = await self._replay(a.start)
                if items is not None:
                    outcome, actions = "ok", self.sequencer.on_replay(items)
                elif self.over_limit:  # the engine's history is more than we take: lost
                    outcome = "over_limit"
                    actions = self.sequencer.on_replay(None, failure=Reason.HISTORY_LOST)
                else:
                    outcome, actions = "failed", self.sequencer.on_replay(None)
                m.replay(outcome)
                self.spans.replayed(span, outcome, len(items or ()))
                out = await self._apply(actions, out)
        return out

    async def _replay(self, start: int) -> list[tuple[int, bytes]] | None:
        """Every batch the engine still holds from ``start`` on, or ``None`` on failure.

        ``replay_timeout`` bounds the wait for each reply message; :class:`IngestLimits` the
        whole replay (batches, payload bytes, seconds): past one of them it is abandoned and
        counted ``over_limit``, and the caller treats the history as lost.
        """
        src = self.source
        assert src.replay_endpoint is not None
        limits = self.limits
        if self._dealer is None:
            dealer = self.ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.setsockopt(zmq.RCVHWM, 0)  # take the whole answer: the engine's ROUTER drops at HWM
            dealer.setsockopt(zmq.MAXMSGSIZE, limits.max_batch_bytes)
            dealer.connect(src.replay_endpoint)
            self._dealer = dealer
        dealer = self._dealer
        items: list[tuple[int, bytes]] = []
        size = 0
        try:
            dealer.send_multipart([b"", seq_bytes(start)], zmq.NOBLOCK)
            with (
                trio.move_on_after(limits.replay_deadline) as whole,
                trio.move_on_after(self.replay_timeout) as scope,
            ):
                while True:
                    frames = await recv_multipart(dealer)
                    scope.deadline = trio.current_time() + self.replay_timeout
                    reply = parse_upstream_reply(frames)
                    if reply is None:
                        return items
                    items.append(reply)
                    size += len(reply[1])
                    if len(items) > limits.replay_max_batches or size > limits.replay_max_bytes:
                        break
            if scope.cancelled_caught:
                log.warning("KV rank %d: replay from %s timed out", src.rank, src.replay_endpoint)
            else:
                self.over_limit = True
                log.warning(
                    "KV rank %d: replay from %s abandoned after %d batches, %d bytes, %s "
                    "(limits: %d batches, %d bytes, %.0f s)",
                    src.rank,
                    src.replay_endpoint,
                    len(items),
                    size,
                    "its deadline" if whole.cancelled_caught else "no end marker yet",
                    limits.replay_max_batches,
                    limits.replay_max_bytes,
                    limits.replay_deadline,
                )
        except (zmq.ZMQError, KvDecodeError) as err:
            log.warning("KV rank %d: replay from %s failed: %s", src.rank, src.replay_endpoint, err)
        self._close_dealer()
        return None
