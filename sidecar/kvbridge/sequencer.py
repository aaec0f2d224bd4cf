"""Per-rank upstream sequence tracking (I/O-free): what to publish, drop, replay or resync.

Two trackers, one per upstream kind; both turn sequence numbers into :data:`Action` lists
that the ingest tasks carry out in order.

:class:`ZmqSequencer` — ZMQ PUB + optional replay ROUTER (docs/design/engine-facts.md):

- in order (``seq == next``) -> :class:`Emit`;
- ``seq < next`` but newer than the last *live* message -> duplicate (a replay already
  delivered it) -> :class:`Duplicate`;
- ``seq <= last live seq`` -> the publisher restarted (a PUB stream never goes backwards):
  :class:`Clear` ``restart``, then the batch is handled as the first one of a new publisher;
- ``seq > next`` (or a first batch with ``seq > 0``: we joined late) -> :class:`Replay` from
  the first missing number, the live batch held until :meth:`ZmqSequencer.on_replay`;
- a replay that starts later than asked, skips numbers or misses the held batch -> lost
  history -> :class:`Clear` ``history_lost`` before the batches that follow; no replay
  endpoint -> :class:`Clear` ``no_replay``; a failed replay -> :class:`Clear` ``replay_failed``.

:class:`GrpcSequencer` — ``SubscribeKvEvents``: resubscribe from the next number after a
gap, an error or the end of the stream; if the engine cannot resume (the first batch is not
the one asked for) or the numbers go back inside a stream (its publisher restarted),
resubscribe with ``include_snapshot`` and publish :class:`Clear` (``restart`` or
``history_lost``) before the snapshot.

A :class:`Clear` is suppressed when nothing was emitted since the previous one (one
``AllBlocksCleared`` says it all).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

P = TypeVar("P")
_A = TypeVar("_A", contravariant=True)


class _Out(Protocol[_A]):
    """Where actions go (a ``list`` of a union that holds ``_A``)."""

    def append(self, action: _A, /) -> None: ...


class Reason(enum.StrEnum):
    """Why the bridge published ``AllBlocksCleared`` for a rank (the ``reason`` metric label)."""

    RESTART = "restart"
    HISTORY_LOST = "history_lost"
    NO_REPLAY = "no_replay"
    REPLAY_FAILED = "replay_failed"
    DECODE_ERROR = "decode_error"


@dataclass(frozen=True, slots=True)
class Emit(Generic[P]):
    """Publish this upstream batch (decode ``payload`` first)."""

    seq: int
    payload: P


@dataclass(frozen=True, slots=True)
class Clear:
    """Publish ``AllBlocksCleared`` for the rank before anything that follows."""

    reason: Reason


@dataclass(frozen=True, slots=True)
class Replay:
    """Ask the replay endpoint for every batch from ``start`` on, then call ``on_replay``.

    ``missing`` is how many numbers the live stream skipped (0 when joining late).
    """

    start: int
    missing: int


@dataclass(frozen=True, slots=True)
class Duplicate:
    """An already published batch came again; it is dropped."""

    seq: int


Action = Emit[P] | Clear | Replay | Duplicate


class _ClearGate:
    __slots__ = ("_clean",)

    def __init__(self, cleared: bool = False) -> None:
        # a first Clear is worth sending (consumers may hold a past view) unless one was just sent
        self._clean = cleared

    def clear(self, out: _Out[Clear], reason: Reason) -> None:
        if not self._clean:
            out.append(Clear(reason))
            self._clean = True

    def emitted(self) -> None:
        self._clean = False


class ZmqSequencer(Generic[P]):
    """Sequencing of one ZMQ publisher (one DP rank). See the module doc for the rules.

    ``can_replay`` says whether the source has a replay endpoint; ``cleared``: an
    ``AllBlocksCleared`` was just published for this rank (none is needed before the first
    batch). While a :class:`Replay` is outstanding, only :meth:`on_replay` may be called.
    """

    __slots__ = ("_gate", "_pending", "_replay_start", "can_replay", "last_live", "next_seq")

    def __init__(self, *, can_replay: bool, cleared: bool = False) -> None:
        self.can_replay = can_replay
        self.next_seq: int | None = None
        self.last_live: int | None = None
        self._pending: tuple[int, P] | None = None
        self._replay_start: int | None = None
        self._gate = _ClearGate(cleared)

    @property
    def replay_outstanding(self) -> bool:
        return self._replay_start is not None

    def clear(self, reason: Reason) -> list[Action[P]]:
        """A resync requested by the caller (e.g. a batch that did not decode)."""
        out: list[Action[P]] = []
        self._gate.clear(out, reason)
        return out

    def _emit(self, out: list[Action[P]], seq: int, payload: P) -> None:
        out.append(Emit(seq, payload))
        self.next_seq = seq + 1
        self._gate.emitted()

    def on_live(self, seq: int, payload: P) -> list[Action[P]]:
        """One batch from the PUB socket."""
        if self._replay_start is not None:
            raise RuntimeError("on_live while a replay is outstanding")
        out: list[Action[P]] = []
        if self.last_live is not None and seq <= self.last_live:
            self._gate.clear(out, Reason.RESTART)
            self.next_seq = None
        self.last_live = seq
        nxt = self.next_seq
        if nxt is None:
            if seq == 0:
                self._emit(out, seq, payload)
                return out
            start = 0
        elif seq == nxt:
            self._emit(out, seq, payload)
            return out
        elif seq < nxt:
            out.append(Duplicate(seq))
            return out
        else:
            start = nxt
        if not self.can_replay:
            self._gate.clear(out, Reason.NO_REPLAY)
            self._emit(out, seq, payload)
            return out
        self._pending = (seq, payload)
        self._replay_start = start
        out.append(Replay(start, seq - start if nxt is not None else 0))
        return out

    def on_replay(
        self, items: list[tuple[int, P]] | None, *, failure: Reason = Reason.REPLAY_FAILED
    ) -> list[Action[P]]:
        """The replay's batches in arrival order, or ``None`` when the replay failed."""
        start, pending = self._replay_start, self._pending
        if start is None or pending is None:
            raise RuntimeError("on_replay without an outstanding replay")
        self._replay_start = None
        self._pending = None
        out: list[Action[P]] = []
        if items is None:
            self._gate.clear(out, failure)
            self._emit(out, *pending)
            return out
        # The held live batch joins the replayed ones in order (the engine's buffer may
        # already have dropped it: then it still comes before what the replay returned).
        merged: list[tuple[int, P]] = []
        pseq = pending[0]
        placed = False
        for item in items:
            if not placed and item[0] >= pseq:
                if item[0] > pseq:
                    merged.append(pending)
                placed = True
            merged.append(item)
        if not placed:
            merged.append(pending)
        nxt = start
        for seq, payload in merged:
            if seq < nxt:
                out.append(Duplicate(seq))
                continue
            if seq > nxt:  # started later than asked, or a hole inside the replay
                self._gate.clear(out, Reason.HISTORY_LOST)
            self._emit(out, seq, payload)
            nxt = seq + 1
        return out

    def on_probe(self, items: list[tuple[int, P]]) -> list[Action[P]]:
        """The batches a replay asked from ``next_seq`` returned (a probe after silence, not
        a gap): published in order like replayed ones — a hole in them clears — without
        moving ``last_live``, so the same batches arriving live later are duplicates."""
        if self._replay_start is not None:
            raise RuntimeError("on_probe while a replay is outstanding")
        out: list[Action[P]] = []
        for seq, payload in items:
            nxt = self.next_seq
            if nxt is not None and seq < nxt:
                out.append(Duplicate(seq))
                continue
            if nxt is not None and seq > nxt:
                self._gate.clear(out, Reason.HISTORY_LOST)
            self._emit(out, seq, payload)
        return out


@dataclass(frozen=True, slots=True)
class Resubscribe:
    """Close this subscription and open the one :meth:`GrpcSequencer.request` describes."""

    snapshot: bool
    gap: bool


GrpcAction = Emit[P] | Clear | Duplicate | Resubscribe


class GrpcSequencer(Generic[P]):
    """Sequencing of one ``SubscribeKvEvents`` subscription chain (one DP rank).

    Call :meth:`request` before each subscription, :meth:`on_batch` for each batch and
    :meth:`on_failure` when a subscription fails with an error that says it cannot resume.
    The :class:`Clear` before a snapshot carries why it was needed: ``restart`` (the engine
    answered a resume with an older number), ``history_lost`` (a newer one, or refused).
    A snapshot batch numbered S may be followed by live batch S (the snapshot holds
    everything before S) or S + 1 (it holds S): both are accepted.
    """

    __slots__ = ("_after_snapshot", "_first", "_gate", "_snapshot", "next_seq")

    def __init__(self, *, cleared: bool = False) -> None:
        self.next_seq: int | None = None
        self._snapshot: Reason | None = None
        self._after_snapshot: int | None = None
        self._first = True
        self._gate = _ClearGate(cleared)

    @property
    def snapshot_pending(self) -> bool:
        return self._snapshot is not None

    def request(self) -> tuple[int, bool]:
        """``(start_sequence_number, include_snapshot)`` for the next subscription."""
        self._first = True
        self._after_snapshot = None
        if self._snapshot is not None:
            return 0, True
        return (self.next_seq or 0), False

    def clear(self, reason: Reason) -> list[GrpcAction[P]]:
        out: list[GrpcAction[P]] = []
        self._gate.clear(out, reason)
        return out

    def skip(self) -> list[GrpcAction[P]]:
        """The next batch could not be taken (too large to read): publish :class:`Clear`
        ``decode_error`` and resume after it (resubscribe from :meth:`request`)."""
        out: list[GrpcAction[P]] = []
        self._gate.clear(out, Reason.DECODE_ERROR)
        self.next_seq = (self.next_seq or 0) + 1
        return out

    def on_failure(self, *, cannot_resume: bool) -> None:
        """The subscription ended in error; ``cannot_resume``: the engine refused the start."""
        if cannot_resume and self._snapshot is None:
            self._snapshot = Reason.HISTORY_LOST

    def _emit(self, out: list[GrpcAction[P]], seq: int, payload: P) -> None:
        out.append(Emit(seq, payload))
        self.next_seq = seq + 1
        self._gate.emitted()

    def on_batch(self, seq: int, payload: P) -> list[GrpcAction[P]]:
        out: list[GrpcAction[P]] = []
        first, self._first = self._first, False
        nxt = self.next_seq
        if first and self._snapshot is not None:
            self._gate.clear(out, self._snapshot)
            self._snapshot = None
            self._emit(out, seq, payload)
            self._after_snapshot = seq
            return out
        snap, self._after_snapshot = self._after_snapshot, None
        if snap is not None and seq == snap:
            # engines differ on a snapshot's number: the last batch folded into it, or the
            # first live batch after it (which then shares the number): both are in order
            self._emit(out, seq, payload)
            return out
        if first:
            want = nxt or 0
            if seq == want:
                self._emit(out, seq, payload)
            else:  # cannot resume where we asked: take a snapshot
                self._snapshot = Reason.RESTART if seq < want else Reason.HISTORY_LOST
                out.append(Resubscribe(snapshot=True, gap=False))
            return out
        assert nxt is not None
        if seq == nxt:
            self._emit(out, seq, payload)
        elif seq < nxt:  # one stream never repeats itself: the engine's publisher restarted
            self._snapshot = Reason.RESTART
            out.append(Resubscribe(snapshot=True, gap=False))
        else:
            out.append(Resubscribe(snapshot=False, gap=True))
        return out
