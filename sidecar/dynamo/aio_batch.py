"""Let the trio-asyncio loop run every asyncio callback already queued, per trio pass.

trio-asyncio runs asyncio on top of trio as ONE trio task that takes one asyncio callback
per trio checkpoint (its ``_main_loop_one``: ``await queue.receive()``, run the callback,
repeat). Every runnable trio task runs between two callbacks, so a callback queued behind
N others waits N whole scheduler passes. Dynamo's runtime drives the worker's handler
through several callbacks per chunk (its threads' ``call_soon_threadsafe`` to start each
``__anext__``, the task's steps, the done callback that hands the chunk back), so under load
a request's first chunk queued behind every other stream's callbacks: with 16 streams the
queue held ~20 callbacks and a callback from Dynamo's threads waited 10-19 ms at p90.

:func:`batch_ready_callbacks` makes one loop take, after each callback it waited for, the
callbacks queued at that moment (at most :data:`MAX_BATCH`) without a trio checkpoint in
between — asyncio's own loop runs all ready callbacks per iteration the same way. Callbacks
those queue run at the next pass, so trio tasks still run between batches.

It relies on trio-asyncio 0.16's private ``_main_loop_one(no_wait)``, ``_q_recv`` and
``_stopped`` (pinned ``<0.17`` in pyproject.toml); a loop without them is left as it is
(logged once), which only costs latency. ``tests/dynamo/test_aio_batch.py`` fails when the
internals change.
"""

from __future__ import annotations

import logging
from typing import Any

import trio

log = logging.getLogger(__name__)

#: Most callbacks run in one batch, after the one the loop waited for.
MAX_BATCH = 512
_MARK = "_sidecar_batches_ready_callbacks"


def batch_ready_callbacks(loop: Any) -> bool:
    """Make ``loop`` (a running ``trio_asyncio`` loop) run its queued callbacks in batches.

    Idempotent; True when the loop batches. Affects only this loop object (its main-loop
    task looks ``_main_loop_one`` up on the instance at every callback)."""
    if getattr(loop, _MARK, False):
        return True
    one = getattr(type(loop), "_main_loop_one", None)
    queue = getattr(loop, "_q_recv", None)
    if one is None or queue is None or not hasattr(loop, "_stopped"):
        log.warning("trio-asyncio's loop internals changed: asyncio callbacks run one per trio pass")
        return False

    async def main_loop_one(no_wait: bool = False) -> None:
        await one(loop, no_wait)
        n = min(queue.statistics().current_buffer_used, MAX_BATCH)
        while n > 0 and not loop._stopped.is_set():
            n -= 1
            try:
                await one(loop, True)
            except trio.WouldBlock:
                return

    loop._main_loop_one = main_loop_one
    setattr(loop, _MARK, True)
    return True
