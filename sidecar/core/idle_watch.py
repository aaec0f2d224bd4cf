"""One timer per trio run for every stream's bound on waiting for the engine.

A stream bounds how long it waits for the engine's next event (``--first-event-timeout``,
``--inactivity-timeout``), and only while it waits: the time it spends handing an event to a
slow client does not count. A cancel scope's deadline would have to move twice per event (off
while the event is relayed, on again before the next wait), and trio re-registers a deadline
through a context manager each time. Here a waiting stream writes one float
(:meth:`Waiter.arm`), and one system task per run (:class:`IdleWatch`) sleeps until the
earliest expiry and cancels the scope of each stream whose wait ran out.

The watch wakes when its earliest waiter expires, or earlier only when a waiter arms an expiry
before it (a stream's first-event bound shorter than what the watch sleeps for): at most one
deadline change per wake instead of two per event.
"""

from __future__ import annotations

import math

import trio
from trio.lowlevel import RunVar


class Waiter:
    """One stream's bound: while registered (``with``), :meth:`arm` starts a wait that, not
    ended by :meth:`disarm` within ``timeout``, cancels ``scope``."""

    __slots__ = ("_watch", "expires", "scope")

    def __init__(self, watch: IdleWatch, scope: trio.CancelScope) -> None:
        self._watch = watch
        self.scope = scope
        #: When the current wait runs out (run clock); ``inf`` while not waiting.
        self.expires = math.inf

    def arm(self, timeout: float) -> None:
        """Start a wait bounded by ``timeout`` seconds from now."""
        expires = self.expires = trio.current_time() + timeout
        watch = self._watch
        if expires < watch.wakes_at:
            watch.wake_at(expires)

    def disarm(self) -> None:
        """The wait ended (an event arrived)."""
        self.expires = math.inf

    def __enter__(self) -> Waiter:
        self._watch.waiters.add(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self._watch.waiters.discard(self)
        self.disarm()


class IdleWatch:
    """The run's timer task and the waiters it watches (:func:`waiter` starts it on first use;
    it ends with the run: a system task, cancelled when the main task has returned)."""

    def __init__(self) -> None:
        self.waiters: set[Waiter] = set()
        #: When the task is due to wake next (``inf``: asleep until a waiter arms).
        self.wakes_at = math.inf
        self._sleep = trio.CancelScope()

    def wake_at(self, when: float) -> None:
        """Wake the task at ``when`` (earlier than planned): one deadline change."""
        self.wakes_at = when
        self._sleep.deadline = when

    def expire(self, now: float) -> float:
        """Fire every waiter whose wait ran out by ``now``; the earliest expiry left."""
        earliest = math.inf
        for waiter in tuple(self.waiters):  # (a cancel runs the waiting task's abort function)
            expires = waiter.expires
            if expires <= now:
                waiter.expires = math.inf
                waiter.scope.cancel()
            elif expires < earliest:
                earliest = expires
        return earliest

    async def run(self) -> None:
        """Fire what ran out, sleep until the earliest expiry left; until the run cancels it."""
        while True:
            self.wakes_at = self.expire(trio.current_time())
            self._sleep = trio.CancelScope(deadline=self.wakes_at)
            with self._sleep:
                await trio.sleep_forever()


_WATCH: RunVar[IdleWatch] = RunVar("sidecar.idle_watch")


def waiter(scope: trio.CancelScope) -> Waiter:
    """A waiter on this run's watch (started here on first use) that cancels ``scope``."""
    try:
        watch = _WATCH.get()
    except LookupError:
        watch = IdleWatch()
        trio.lowlevel.spawn_system_task(watch.run, name="sidecar idle watch")
        _WATCH.set(watch)
    return Waiter(watch, scope)
