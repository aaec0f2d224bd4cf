"""The simulated engine's structured concurrency (sidecar/mock/__init__.py): a request's
wake-ups, an Abort racing other work, leaked requests held in the engine's task group."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from sidecar.mock import runner
from sidecar.mock.config import EngineConfig
from sidecar.mock.engine import ABORTED, ORPHAN_EXPIRED, SHUTDOWN, MockEngine, Request
from sidecar.openengine import pb


def engine_with(**fields: Any) -> MockEngine:
    fields.setdefault("orphans", "hold")
    engine = MockEngine(EngineConfig(flavor="vllm", role="aggregated", **fields))
    engine.start()
    return engine


def accepted(engine: MockEngine, rid: str) -> Request:
    return engine.accept(pb.GenerateRequest(request_id=rid, model=engine.model, prompt="hi"), [])


def run(coro: Any) -> Any:
    async def bounded() -> Any:
        async with asyncio.timeout(10):
            return await coro

    return asyncio.run(bounded())


def test_wait_woken_ends_at_a_wake_or_at_its_bound() -> None:
    async def main() -> tuple[float, float]:
        loop = asyncio.get_running_loop()
        req = accepted(engine_with(), "r")
        t0 = loop.time()
        await req.wait_woken(0.05)
        timed_out = loop.time() - t0
        loop.call_soon(req.wake)
        t0 = loop.time()
        await req.wait_woken(None)
        woken = loop.time() - t0
        req.wake()  # not waiting: nothing to wake, nothing kept for the next wait
        return timed_out, woken

    timed_out, woken = run(main())
    assert 0.05 <= timed_out < 1.0 and woken < 0.05


def test_abortable_abort_cancels_the_work() -> None:
    async def main() -> tuple[bool, bool]:
        req = accepted(engine_with(), "r")
        started, cancelled = asyncio.Event(), asyncio.Event()

        async def forever() -> None:
            started.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                cancelled.set()
                raise

        async def abort_soon() -> None:
            await started.wait()
            req.abort_reason = "abort"
            req.wake()

        async with asyncio.TaskGroup() as group:
            group.create_task(abort_soon())
            with pytest.raises(runner._Aborted):
                await runner._abortable(req, forever())
        return cancelled.is_set(), req._woken is None

    assert run(main()) == (True, True)


def test_abortable_returns_the_result_and_raises_the_works_own_error() -> None:
    async def main() -> int:
        req = accepted(engine_with(), "r")

        async def answer() -> int:
            await asyncio.sleep(0)
            return 7

        async def broken() -> int:
            raise ValueError("engine-side failure")

        with pytest.raises(ValueError, match="engine-side failure"):  # itself, not a group
            await runner._abortable(req, broken())
        return await runner._abortable(req, answer())

    assert run(main()) == 7


def test_abortable_after_the_abort_does_not_start_the_work() -> None:
    async def main() -> None:
        req = accepted(engine_with(), "r")
        req.abort_reason = "abort"
        ran = []

        async def work() -> None:
            ran.append(1)

        with pytest.raises(runner._Aborted):
            await runner._abortable(req, work())
        assert not ran

    run(main())


def test_a_leaked_request_is_held_until_the_orphan_timeout() -> None:
    async def main() -> tuple[str, float]:
        engine = engine_with(orphan_timeout_s=0.05)
        loop = asyncio.get_running_loop()
        async with engine.serving():
            req = accepted(engine, "leaked")
            engine.changed.clear()
            t0 = loop.time()
            engine.client_gone(req)
            assert engine.counters.requests_leaked == 1 and not req.done
            await engine.changed.wait()  # set when the request ends
            took = loop.time() - t0
        return engine.recent["leaked"]["outcome"], took

    outcome, took = run(main())
    assert outcome == ORPHAN_EXPIRED and 0.05 <= took < 1.0


def test_leaving_serving_releases_held_requests_at_once() -> None:
    async def main() -> tuple[str, float, bool]:
        engine = engine_with(orphan_timeout_s=60.0)
        loop = asyncio.get_running_loop()
        async with engine.serving():
            held = accepted(engine, "held")
            engine.client_gone(held)
            assert not held.done
            t0 = loop.time()
        took = loop.time() - t0
        late = accepted(engine, "late")
        engine.client_gone(late)  # no longer serving: nothing holds it
        return engine.recent["held"]["outcome"], took, late.done

    outcome, took, late_done = run(main())
    assert outcome == SHUTDOWN and took < 1.0 and late_done


@pytest.mark.parametrize("orphans", ["hold", "release"])
def test_a_client_leaving_after_its_abort_ends_the_request_aborted(orphans: str) -> None:
    """The Abort reaches the engine before the stream's reset and the reset cancels the
    handler before it sends the CANCELLED terminal: the Abort ended the request, so it counts
    as aborted, once (it used to end ``cancelled``, counted in no outcome)."""

    async def main() -> tuple[str, dict[str, Any]]:
        engine = engine_with(orphans=orphans)
        async with engine.serving():
            req = accepted(engine, "r")
            reply = engine.abort(pb.AbortRequest(request_id="r"))
            assert reply.status == pb.AbortStatus.ABORTED
            engine.client_gone(req)  # the handler's CancelledError, before it ran again
            assert req.done
        attrs = engine.counters.snapshot(in_flight=engine.in_flight, kv_sessions_open=0)
        return engine.recent["r"]["outcome"], attrs

    outcome, attrs = run(main())
    assert outcome == ABORTED
    counts = ("requests_aborted", "requests_cancelled_by_client", "requests_leaked", "requests_in_flight")
    assert [attrs[k] for k in counts] == [1, 0, 0, 0]


def test_serving_passes_the_blocks_own_error_through() -> None:
    async def main() -> None:
        async with engine_with().serving():
            raise KeyError("body")

    with pytest.raises(KeyError):  # itself, not wrapped in a group
        run(main())
