"""``sidecar.dynamo.aio_batch``: the trio-asyncio loop runs its queued callbacks per trio pass.

Deterministic: time is counted in trio scheduler passes (a task that checkpoints once per
pass), never in seconds. trio runs a pass's tasks in a random order, so the loop's task can
see one count in two consecutive passes (before the counter in one, after it in the next):
the bounds below allow that. The first test also shows trio-asyncio's own behaviour on a loop
left as it is (one callback per pass), so a trio-asyncio that changes it fails here.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import trio
import trio_asyncio

from sidecar.dynamo.aio_batch import MAX_BATCH, batch_ready_callbacks


@asynccontextmanager
async def pass_counter() -> AsyncIterator[Callable[[], int]]:
    """A trio task that counts scheduler passes (it checkpoints once per pass)."""
    passes = 0

    async def count() -> None:
        nonlocal passes
        while True:
            passes += 1
            await trio.lowlevel.checkpoint()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(count)
        await trio.lowlevel.checkpoint()
        yield lambda: passes
        nursery.cancel_scope.cancel()


async def passes_to_run(loop: Any, n: int) -> list[int]:
    """Queue ``n`` callbacks at once; the pass at which each one ran."""
    ran: list[int] = []
    done = trio.Event()
    async with pass_counter() as passes:

        def callback() -> None:
            ran.append(passes())
            if len(ran) == n:
                done.set()

        for _ in range(n):
            loop.call_soon(callback)
        await done.wait()
    return ran


async def test_callbacks_queued_together_run_in_one_pass() -> None:
    with trio.fail_after(10):
        async with trio_asyncio.open_loop() as loop:
            plain = await passes_to_run(loop, 100)
            assert plain[-1] - plain[0] >= 49  # trio-asyncio alone: one callback per pass
            assert batch_ready_callbacks(loop) and batch_ready_callbacks(loop)  # idempotent
            await passes_to_run(loop, 1)  # the wait begun before batching ends with one callback
            batched = await passes_to_run(loop, 100)
            assert batched[-1] - batched[0] <= 1


async def test_a_batch_is_bounded_and_trio_tasks_run_between_batches() -> None:
    """Callbacks queued by a batch wait for the next pass, and one batch runs at most
    ``MAX_BATCH`` more: a callback that requeues itself for ever does not starve trio."""
    with trio.fail_after(10):
        async with trio_asyncio.open_loop() as loop:
            batch_ready_callbacks(loop)
            async with pass_counter() as passes:
                runs: dict[int, int] = {}
                stop = False

                def spin() -> None:
                    if not stop:
                        runs[passes()] = runs.get(passes(), 0) + 1
                        loop.call_soon(spin)

                for _ in range(3 * MAX_BATCH):
                    loop.call_soon(spin)
                start = passes()
                while passes() < start + 20:
                    await trio.lowlevel.checkpoint()
                stop = True
            assert max(runs.values()) <= 2 * (MAX_BATCH + 1)
            assert len(runs) >= 10  # the spinning callbacks ran on most passes, and trio went on


async def test_timers_and_trio_tasks_still_run_from_a_batch() -> None:
    """A batch that holds a timer and a Trio task started from asyncio (``trio_as_future``)."""
    with trio.fail_after(10):
        async with trio_asyncio.open_loop() as loop:
            batch_ready_callbacks(loop)

            async def trio_side() -> str:
                await trio.sleep(0.01)
                return "trio"

            async def aio_side() -> list[str]:
                timer: asyncio.Future[str] = loop.create_future()
                loop.call_later(0.01, timer.set_result, "timer")
                got = await asyncio.gather(timer, loop.trio_as_future(trio_side), asyncio.sleep(0, "sleep"))
                return list(got)

            assert await trio_asyncio.aio_as_trio(aio_side)() == ["timer", "trio", "sleep"]


async def test_a_loop_without_the_internals_is_left_alone() -> None:
    class NotTrioAsyncio:
        pass

    loop = NotTrioAsyncio()
    assert not batch_ready_callbacks(loop)
    assert not hasattr(loop, "_main_loop_one")
