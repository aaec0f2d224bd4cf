"""The suite's one bounded-polling helper.

For state that offers no event to wait on — another process's counters, an HTTP endpoint,
metrics, the asyncio side's timers. Anything the test itself can signal waits on a
``trio.Event`` (or a channel) instead.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import TypeVar

import trio

T = TypeVar("T")

__all__ = ["eventually"]


async def eventually(
    check: Callable[[], T | Awaitable[T]], timeout: float = 10.0, *, interval: float = 0.02
) -> T:
    """Call ``check()`` (a plain function, or one returning an awaitable) every ``interval``
    seconds until its result is truthy, and return that result; ``trio.TooSlowError`` after
    ``timeout`` seconds."""
    with trio.fail_after(timeout):
        while True:
            result = check()
            if inspect.isawaitable(result):
                result = await result
            if result:
                return result  # type: ignore[return-value]
            await trio.sleep(interval)
