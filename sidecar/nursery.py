"""Nursery helpers for context managers that run background tasks around their body."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio


@asynccontextmanager
async def open_background_nursery() -> AsyncIterator[trio.Nursery]:
    """A nursery whose body's lone exception propagates unwrapped.

    Context managers that keep helper tasks alive around ``yield`` would otherwise turn every
    exception raised by their caller's ``async with`` body into an ``ExceptionGroup``. The
    helper tasks must not raise (they report failures by other means); when exactly one
    exception escapes, it is re-raised as itself. Anything else stays a group.
    """
    try:
        async with trio.open_nursery() as nursery:
            yield nursery
    except BaseExceptionGroup as group:
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise
