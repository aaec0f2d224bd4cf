"""Admission and scheduling of one data-parallel rank (I/O-free).

A rank runs at most ``max_running`` requests; up to ``max_queue`` more wait in a queue
ordered by priority (higher first, ``openengine-priority``) then arrival. A request that
finds both full is refused (``OVERLOADED``, before acceptance). When a running request
ends, the head of the queue is promoted; the caller wakes it.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable, Sequence
from typing import Generic, TypeVar

T = TypeVar("T", bound=Hashable)


class Overloaded(Exception):
    """The rank has no running slot and no queue room."""


class RankScheduler(Generic[T]):
    """Running set + priority queue of one rank."""

    def __init__(self, rank: int, max_running: int, max_queue: int) -> None:
        self.rank = rank
        self.max_running = max_running
        self.max_queue = max_queue
        self.running: set[T] = set()
        self._queue: list[tuple[int, int, T]] = []
        self._queued: set[T] = set()
        self._order = itertools.count()
        self.admitted_total = 0

    @property
    def queued(self) -> int:
        return len(self._queued)

    @property
    def load(self) -> int:
        return len(self.running) + len(self._queued)

    def admit(self, item: T, priority: int = 0) -> bool:
        """Admit ``item``: True = runs now, False = queued. Raises :class:`Overloaded`."""
        if len(self.running) < self.max_running and not self._queued:
            self.running.add(item)
            self.admitted_total += 1
            return True
        if len(self._queued) >= self.max_queue:
            raise Overloaded(
                f"rank {self.rank}: {len(self.running)} running (max {self.max_running}) and "
                f"{len(self._queued)} queued (max {self.max_queue})"
            )
        heapq.heappush(self._queue, (-priority, next(self._order), item))
        self._queued.add(item)
        self.admitted_total += 1
        return False

    def is_running(self, item: T) -> bool:
        return item in self.running

    def release(self, item: T) -> list[T]:
        """Forget ``item`` (running or queued); returns the items promoted to running."""
        if item in self._queued:
            self._queued.discard(item)  # lazily dropped from the heap
        else:
            self.running.discard(item)
        return self._promote()

    def _promote(self) -> list[T]:
        promoted: list[T] = []
        while self._queue and len(self.running) < self.max_running:
            _, _, item = heapq.heappop(self._queue)
            if item not in self._queued:
                continue
            self._queued.discard(item)
            self.running.add(item)
            promoted.append(item)
        return promoted


def pick_rank(ranks: Sequence[RankScheduler[T]], target: int | None = None) -> RankScheduler[T]:
    """The rank a request goes to: ``target`` when given, else the least loaded (lowest index on ties)."""
    if target is not None:
        return ranks[target]
    return min(ranks, key=lambda r: (r.load, r.rank))
