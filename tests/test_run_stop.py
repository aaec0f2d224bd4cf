"""``run``'s stop (``run_command._stop``) on trio's MockClock: leaving Dynamo is its first,
explicit step, before the drain, and a second signal during it is honoured at once."""

from __future__ import annotations

import signal

import trio
import trio.testing

from sidecar.core.lifecycle import LifecycleConfig
from sidecar.core.shutdown import stop_budget
from sidecar.core.sidecar import Sidecar, SidecarConfig
from sidecar.run_command import _stop
from tests.fake_engine import FakeEngine

GRACE, DRAIN, ABORT = 30.0, 20.0, 2.0


class Plane:
    """A Dynamo plane that leaves: its grace is a sleep (as ``DynamoPlane.leave``'s)."""

    leave_budget = GRACE

    def __init__(self, sidecar: Sidecar, log: list[str]) -> None:
        self.sidecar, self.log = sidecar, log

    async def leave(self) -> None:
        self.log.append(f"leave (draining={self.sidecar.draining})")
        await trio.sleep(GRACE)
        self.log.append("left")


class North:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def close(self) -> None:
        self.log.append("north closed")

    async def wait_closed(self) -> None:
        pass


def sidecar() -> Sidecar:
    config = SidecarConfig(drain_timeout=DRAIN, lifecycle=LifecycleConfig(abort_timeout=ABORT))
    return Sidecar(FakeEngine(), config)  # type: ignore[arg-type]


async def test_leave_is_the_first_step_then_the_drain(autojump_clock: trio.testing.MockClock) -> None:
    sc, log = sidecar(), []
    send, signals = trio.open_memory_channel[int](1)
    async with send:
        start = trio.current_time()
        await _stop(sc, North(log), Plane(sc, log), None, signals, signal.SIGTERM)  # type: ignore[arg-type]
    assert log == ["leave (draining=False)", "left", "north closed"]  # still serving while leaving
    assert sc.draining
    assert trio.current_time() - start == GRACE  # nothing in flight: the drain ends at once


async def test_a_second_signal_while_leaving_stops_at_once(autojump_clock: trio.testing.MockClock) -> None:
    sc, log = sidecar(), []
    send, signals = trio.open_memory_channel[int](1)
    async with trio.open_nursery() as nursery:
        start = trio.current_time()

        async def second() -> None:
            await trio.sleep(1.0)
            await send.send(signal.SIGINT)

        nursery.start_soon(second)
        await _stop(sc, North(log), Plane(sc, log), None, signals, signal.SIGTERM)  # type: ignore[arg-type]
        took = trio.current_time() - start
    assert log == ["leave (draining=False)", "north closed"]  # the grace cut short, no drain
    assert sc.draining
    assert 1.0 <= took <= 1.0 + stop_budget(ABORT), took
