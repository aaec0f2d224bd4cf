"""The run's idle watch (sidecar.core.idle_watch) on trio's MockClock (``autojump_clock``):
each wait fires at its own expiry, only while armed, whatever the order waits were armed in."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from sidecar.core import idle_watch


async def wait_out(timeout: float, fired: dict[str, float], name: str) -> None:
    """Arm a wait of ``timeout`` and block until the watch cancels it; record when."""
    with trio.CancelScope() as scope, idle_watch.waiter(scope) as waiter:
        waiter.arm(timeout)
        await trio.sleep_forever()
    fired[name] = trio.current_time()


async def test_a_wait_that_runs_out_cancels_its_scope_at_its_expiry(autojump_clock: Any) -> None:
    fired: dict[str, float] = {}
    t0 = trio.current_time()
    await wait_out(5.0, fired, "a")
    assert fired["a"] - t0 == pytest.approx(5.0)


async def test_a_wait_armed_later_with_an_earlier_expiry_wakes_the_watch(autojump_clock: Any) -> None:
    """The watch sleeps until the 30 s wait's expiry; a 1 s wait armed after it fires at 1 s."""
    fired: dict[str, float] = {}
    t0 = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(wait_out, 30.0, fired, "long")
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(wait_out, 1.0, fired, "short")
    assert fired["short"] - t0 == pytest.approx(1.0)
    assert fired["long"] - t0 == pytest.approx(30.0)


async def test_many_waits_each_fire_at_their_own_expiry(autojump_clock: Any) -> None:
    fired: dict[str, float] = {}
    timeouts = [7.0, 2.0, 9.0, 2.5, 0.5, 4.0, 4.0, 11.0]
    t0 = trio.current_time()
    async with trio.open_nursery() as nursery:
        for i, timeout in enumerate(timeouts):
            nursery.start_soon(wait_out, timeout, fired, str(i))
    assert [fired[str(i)] - t0 for i in range(len(timeouts))] == pytest.approx(timeouts)


async def test_a_wait_rearmed_in_time_never_fires_until_it_stops(autojump_clock: Any) -> None:
    """Re-armed every 0.5 s with a 1 s bound for 20 s: not cancelled; the last arm fires 1 s on."""
    with trio.CancelScope() as scope, idle_watch.waiter(scope) as waiter:
        for _ in range(40):
            waiter.arm(1.0)
            await trio.sleep(0.5)
        assert not scope.cancel_called
        last = trio.current_time()
        waiter.arm(1.0)
        await trio.sleep_forever()
    assert scope.cancelled_caught
    assert trio.current_time() - last == pytest.approx(1.0)


async def test_a_disarmed_or_left_wait_never_fires(autojump_clock: Any) -> None:
    with trio.CancelScope() as disarmed, idle_watch.waiter(disarmed) as waiter:
        waiter.arm(1.0)
        await trio.sleep(0.5)
        waiter.disarm()
        await trio.sleep(10.0)
    with trio.CancelScope() as left:
        with idle_watch.waiter(left) as waiter:
            waiter.arm(1.0)
            await trio.sleep(0.5)
        await trio.sleep(10.0)
    assert not disarmed.cancel_called and not left.cancel_called


async def test_one_watch_per_run_keeps_only_registered_waiters(autojump_clock: Any) -> None:
    first = idle_watch.waiter(trio.CancelScope())
    second = idle_watch.waiter(trio.CancelScope())
    watch = first._watch
    assert second._watch is watch
    with first, second:
        assert watch.waiters == {first, second}
    assert not watch.waiters
