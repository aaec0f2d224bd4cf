"""Drain, Abort bounds and the engine watch on trio's MockClock (``autojump_clock``): the
timings are exact, with an in-memory engine (tests/core/shapes.FakeClient)."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from sidecar.core.lifecycle import CANCELLED, COMPLETED, LifecycleConfig, Outcome
from sidecar.core.shutdown import stop_budget
from sidecar.core.sidecar import Sidecar, SidecarConfig
from sidecar.openengine import pb
from sidecar.openengine.errors import EngineUnavailable

from .shapes import FakeClient, tokens_every, vllm_info

DRAIN, ABORT = 10.0, 2.0


def sidecar_with(client: FakeClient, **lifecycle: Any) -> Sidecar:
    config = SidecarConfig(
        drain_timeout=DRAIN,
        health_interval=1.0,
        call_timeout=5.0,
        lifecycle=LifecycleConfig(abort_timeout=ABORT, **lifecycle),
    )
    return Sidecar(client, config)  # type: ignore[arg-type]


def by_request(**scripts: Any) -> Any:
    async def script(request: pb.GenerateRequest, send: Any) -> None:
        await scripts[request.request_id](request, send)

    return script


async def run_streams(sidecar: Sidecar, nursery: trio.Nursery, *ids: str) -> dict[str, Outcome]:
    outcomes: dict[str, Outcome] = {}

    async def emit(ev: pb.GenerateResponse) -> None:
        pass

    async def one(rid: str) -> None:
        handle = sidecar.admit(pb.GenerateRequest(request_id=rid, model="llama", prompt="hi"), {})
        outcomes[rid] = await sidecar.run_stream(handle, emit)

    for rid in ids:
        nursery.start_soon(one, rid)
    await trio.sleep(0.5)  # every stream has its first token by now
    return outcomes


async def test_drain_lets_streams_finish_then_cancels_the_rest(autojump_clock: Any) -> None:
    client = FakeClient(
        vllm_info(), script=by_request(quick=tokens_every(1.0, 3), slow=tokens_every(1.0, -1))
    )
    sidecar = sidecar_with(client)
    await sidecar.startup()
    async with trio.open_nursery() as nursery:
        await nursery.start(sidecar.supervisor.run_service)
        outcomes = await run_streams(sidecar, nursery, "quick", "slow")
        t0 = trio.current_time()
        await sidecar.drain()
        took = trio.current_time() - t0
        assert sidecar.not_ready_reason() == "draining"
        nursery.cancel_scope.cancel()
    assert took == pytest.approx(DRAIN)  # the grace, then the stuck stream cancelled and aborted at once
    assert outcomes["quick"].kind == COMPLETED
    assert outcomes["slow"].kind == CANCELLED and outcomes["slow"].code == pb.ErrorCode.DRAINING
    assert [c for c in client.calls if c.startswith("Abort")] == ["Abort:slow"]


async def test_drain_waits_for_unanswered_aborts_at_most_the_stop_budget(autojump_clock: Any) -> None:
    client = FakeClient(vllm_info(), script=tokens_every(1.0, -1), abort_delay=1000)
    sidecar = sidecar_with(client)
    await sidecar.startup()
    async with trio.open_nursery() as nursery:
        await nursery.start(sidecar.supervisor.run_service)
        outcomes = await run_streams(sidecar, nursery, "a", "b")
        t0 = trio.current_time()
        await sidecar.drain()
        took = trio.current_time() - t0
        nursery.cancel_scope.cancel()
    assert took == pytest.approx(DRAIN + ABORT) and took <= DRAIN + stop_budget(ABORT)
    assert {o.kind for o in outcomes.values()} == {CANCELLED}


async def test_abort_waiting_for_a_slot_is_bounded_by_abort_timeout(autojump_clock: Any) -> None:
    """The slot wait and the call share one ``abort_timeout`` (it once took twice that)."""
    client = FakeClient(vllm_info(), abort_delay=1000)
    sidecar = sidecar_with(client, max_concurrent_aborts=1)
    supervisor = sidecar.supervisor
    took: dict[str, float] = {}

    async def abort(rid: str) -> None:
        t0 = trio.current_time()
        await supervisor.abort(rid)
        took[rid] = trio.current_time() - t0

    async with trio.open_nursery() as nursery:
        await nursery.start(supervisor.run_service)
        nursery.start_soon(abort, "first")  # holds the only slot until its own deadline
        await trio.sleep(1.0)
        await abort("second")  # a slot after 1 s, then the call gets what is left
        nursery.cancel_scope.cancel()
    assert took == {"first": pytest.approx(ABORT), "second": pytest.approx(ABORT)}


async def test_engine_watch_loses_and_regains_the_engine(autojump_clock: Any) -> None:
    client = FakeClient(vllm_info())
    sidecar = sidecar_with(client)
    await sidecar.startup()
    state = {"mode": "ok"}

    async def health() -> pb.HealthResponse:
        if state["mode"] == "down":
            raise EngineUnavailable("connection refused")
        if state["mode"] == "slow":
            await trio.sleep(60)
        return pb.HealthResponse(state=pb.HealthState.READY)

    client.health_script = health
    async with trio.open_nursery() as nursery:
        await nursery.start(sidecar.watch_engine)
        await trio.sleep(2.5)
        assert sidecar.not_ready_reason() is None
        # one slow answer is tolerated; the second in a row marks the engine lost
        state["mode"] = "slow"
        changed = sidecar.changes()
        t0 = trio.current_time()
        await changed.wait()
        assert trio.current_time() - t0 == pytest.approx(0.5 + 5 + 1 + 5)  # next tick, timeout, tick, timeout
        assert sidecar.not_ready_reason() == "engine unreachable: no answer in time"
        # refused: still lost; back: rediscovered and ready at the next reconnect attempt
        state["mode"] = "down"
        await trio.sleep(5)
        assert sidecar.engine_state == "unreachable"
        discoveries = client.calls.count("GetServerInfo")
        state["mode"] = "ok"
        changed = sidecar.changes()
        await changed.wait()
        assert sidecar.not_ready_reason() is None
        assert client.calls.count("GetServerInfo") == discoveries + 1
        nursery.cancel_scope.cancel()


async def test_changes_event_follows_readiness_and_draining(autojump_clock: Any) -> None:
    client = FakeClient(vllm_info())
    sidecar = sidecar_with(client)
    event = sidecar.changes()
    await sidecar.startup()
    assert event.is_set()  # card and readiness
    event = sidecar.changes()
    sidecar.start_draining()
    assert event.is_set() and sidecar.not_ready_reason() == "draining"
