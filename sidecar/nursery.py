"""Nursery helpers: what a nursery raised, and a nursery for context managers that run
background tasks around their body.

trio wraps whatever leaves a nursery in an ``ExceptionGroup``, nested once per nursery it
crossed. Two things are done with such groups here, and only here:

- :func:`lone_exception` names the one exception a group stands for, for callers that
  report or translate it (a CLI's one-line error, a check's verdict);
- :func:`first_leaf` picks the first concrete exception of any group, for callers that
  describe a failure by one example (a connection error's cause, a log line);
- :func:`open_background_nursery` re-raises that one exception unwrapped, for context
  managers whose helper tasks never raise, so that their caller's ``async with`` body keeps
  its own exceptions (``except ValueError`` still works around it).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio

__all__ = ["first_leaf", "lone_exception", "open_background_nursery"]


def lone_exception(exc: BaseException) -> BaseException:
    """The exception ``exc`` stands for: through groups that hold exactly one member (at every
    level of nesting), the innermost one; ``exc`` itself when it is not a group, or when some
    level holds several (then no single exception is meant, and the group is the answer)."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


def first_leaf(exc: BaseException) -> BaseException:
    """The first member at every level of nesting: the first non-group exception of ``exc``
    (``exc`` itself when it is not a group). Unlike :func:`lone_exception` this answers for
    groups of several too, by example: use it to describe a failure, never to decide one."""
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


@asynccontextmanager
async def open_background_nursery() -> AsyncIterator[trio.Nursery]:
    """A nursery whose lone exception propagates as itself (:func:`lone_exception`).

    For context managers that keep helper tasks alive around ``yield``: without it every
    exception their caller's body raises would reach the caller as an ``ExceptionGroup``. The
    helper tasks must not raise (they report failures by other means). Several exceptions at
    once stay a group.
    """
    try:
        async with trio.open_nursery() as nursery:
            yield nursery
    except BaseExceptionGroup as group:
        lone = lone_exception(group)
        if lone is group:
            raise
        raise lone from None
