"""Drain, Abort bounds and the engine watch on trio's MockClock (``autojump_clock``): the
timings are exact, with an in-memory engine (tests.fake_engine)."""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.lowlevel

from sidecar.core import metrics
from sidecar.core.errors import Rejection
from sidecar.core.lifecycle import CANCELLED, COMPLETED, FAILED, LifecycleConfig, Outcome, StreamHandle
from sidecar.core.shutdown import stop_budget
from sidecar.core.sidecar import Sidecar, SidecarConfig
from sidecar.openengine import pb
from sidecar.openengine.engine_errors import EngineUnavailable
from tests.fake_engine import FakeEngine, status, tokens_every

from .shapes import vllm_info

DRAIN, ABORT = 10.0, 2.0


def sidecar_with(client: FakeEngine, **lifecycle: Any) -> Sidecar:
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
    """Admit a stream per id and run each in ``nursery``; returns (once every stream relayed its
    first event) the dict their outcomes will be in."""
    outcomes: dict[str, Outcome] = {}
    first = {rid: trio.Event() for rid in ids}

    async def one(handle: StreamHandle) -> None:
        async def emit(ev: pb.GenerateResponse) -> None:
            first[handle.request_id].set()

        outcomes[handle.request_id] = await sidecar.run_stream(handle, emit)

    for rid in ids:
        handle = sidecar.admit(pb.GenerateRequest(request_id=rid, model="llama", prompt="hi"), {})
        nursery.start_soon(one, handle)
    for event in first.values():
        await event.wait()
    return outcomes


async def test_drain_lets_streams_finish_then_cancels_the_rest(autojump_clock: Any) -> None:
    client = FakeEngine(
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
    client = FakeEngine(vllm_info(), script=tokens_every(1.0, -1), abort_delay=1000)
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
    client = FakeEngine(vllm_info(), abort_delay=1000)
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
    client = FakeEngine(vllm_info())
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
        assert client.calls.count("ProbeLiveness") == 1  # PINGs sent at the first slow answer only
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
    client = FakeEngine(vllm_info())
    sidecar = sidecar_with(client)
    event = sidecar.changes()
    await sidecar.startup()
    assert event.is_set()  # card and readiness
    event = sidecar.changes()
    sidecar.start_draining()
    assert event.is_set() and sidecar.not_ready_reason() == "draining"


# -- drain ----------------------------------------------------------------------------------


async def test_drain_refuses_new_work_and_ends_when_the_last_stream_completes(autojump_clock: Any) -> None:
    client = FakeEngine(vllm_info(), script=tokens_every(1.0, 4))
    sidecar = sidecar_with(client)
    await sidecar.startup()
    async with trio.open_nursery() as nursery:
        await nursery.start(sidecar.supervisor.run_service)
        outcomes = await run_streams(sidecar, nursery, "a", "b")  # first tokens at t0+1
        t0 = trio.current_time()
        drained = trio.Event()

        async def drain() -> None:
            await sidecar.drain()
            drained.set()

        changed = sidecar.changes()
        nursery.start_soon(drain)
        await changed.wait()  # draining announced
        assert sidecar.not_ready_reason() == "draining"
        assert metrics.REGISTRY.get_sample_value("openengine_sidecar_draining") == 1
        with pytest.raises(Rejection) as info:
            sidecar.admit(pb.GenerateRequest(request_id="late", model="llama", prompt="hi"), {})
        assert info.value.code == pb.ErrorCode.DRAINING and info.value.retryable
        await drained.wait()
        took = trio.current_time() - t0
        nursery.cancel_scope.cancel()
    assert took == pytest.approx(3.0)  # the streams' last 3 tokens, 1 s apart: no grace waited out
    assert {o.kind for o in outcomes.values()} == {COMPLETED}
    assert not [c for c in client.calls if c.startswith("Abort")]
    assert "Generate:late" not in client.calls


async def test_drain_without_streams_returns_at_once(autojump_clock: Any) -> None:
    sidecar = sidecar_with(FakeEngine(vllm_info()))
    await sidecar.startup()
    t0 = trio.current_time()
    await sidecar.drain()
    assert trio.current_time() == t0 and sidecar.draining


@pytest.mark.parametrize(
    ("events", "error", "feature", "called"),
    [
        ([pb.DrainResponse(state=pb.DrainState.STARTED, in_flight_requests=1)], None, None, True),
        ([], status("UNIMPLEMENTED"), None, True),  # an engine without Drain: local drain only
        ([], None, False, False),  # a schema without Drain: not asked
    ],
)
async def test_drain_engine_asks_the_engine_within_the_grace(
    autojump_clock: Any,
    events: list[pb.DrainResponse],
    error: Exception | None,
    feature: bool | None,
    called: bool,
) -> None:
    client = FakeEngine(vllm_info(), script=tokens_every(1.0, 2), drain_events=events, drain_error=error)
    sidecar = sidecar_with(client)
    sidecar.config.drain_engine = True
    card = await sidecar.startup()
    if feature is not None:
        assert card.compatibility is not None
        card.compatibility.features["drain"] = feature
    async with trio.open_nursery() as nursery:
        await nursery.start(sidecar.supervisor.run_service)
        outcomes = await run_streams(sidecar, nursery, "a")
        t0 = trio.current_time()
        await sidecar.drain()
        took = trio.current_time() - t0
        nursery.cancel_scope.cancel()
    assert took == pytest.approx(1.0) and outcomes["a"].kind == COMPLETED
    assert ("Drain" in client.calls) == called
    if called:
        [request] = client.drain_requests
        assert request.stop_accepting_new_requests and request.abort_after_deadline
        assert request.deadline_ms == int(DRAIN * 1000)


# -- the engine watch -----------------------------------------------------------------------


async def test_engine_watch_follows_the_engines_health_state(autojump_clock: Any) -> None:
    client = FakeEngine(vllm_info())
    sidecar = sidecar_with(client)
    await sidecar.startup()
    state = {"now": pb.HealthState.READY}

    async def health() -> pb.HealthResponse:
        return pb.HealthResponse(state=state["now"])

    client.health_script = health
    async with trio.open_nursery() as nursery:
        await nursery.start(sidecar.watch_engine)
        state["now"] = pb.HealthState.NOT_READY
        t0 = trio.current_time()
        await sidecar.changes().wait()
        assert trio.current_time() - t0 == pytest.approx(1.0)  # the next check
        assert sidecar.not_ready_reason() == "engine health is not_ready"
        assert sidecar.supervisor.engine_reachable.is_open  # answering: not lost, nothing rediscovered
        state["now"] = pb.HealthState.DEGRADED  # degraded still serves
        await sidecar.changes().wait()
        assert sidecar.not_ready_reason() is None and sidecar.engine_state == "degraded"
        nursery.cancel_scope.cancel()
    assert client.calls.count("GetServerInfo") == 1  # startup only


async def refusable_engine() -> tuple[FakeEngine, Sidecar, dict[str, bool]]:
    """A started sidecar whose engine refuses Health while ``down["now"]``."""
    client = FakeEngine(vllm_info())
    sidecar = sidecar_with(client)
    await sidecar.startup()
    down = {"now": False}

    async def health() -> pb.HealthResponse:
        if down["now"]:
            raise EngineUnavailable("connection refused")
        return pb.HealthResponse(state=pb.HealthState.READY)

    client.health_script = health
    return client, sidecar, down


async def test_engine_watch_refused_connection_is_lost_at_once_then_reconnects(autojump_clock: Any) -> None:
    client, sidecar, down = await refusable_engine()
    cfg = sidecar.config
    async with trio.open_nursery() as nursery:
        await nursery.start(sidecar.watch_engine)
        down["now"] = True
        t0 = trio.current_time()
        await sidecar.changes().wait()
        assert trio.current_time() - t0 == pytest.approx(cfg.health_interval)  # one failed check
        assert sidecar.not_ready_reason() == "engine unreachable: connection refused"
        assert not sidecar.supervisor.engine_reachable.is_open  # background Aborts wait
        with pytest.raises(Rejection) as info:
            sidecar.admit(pb.GenerateRequest(request_id="x", model="llama", prompt="hi"), {})
        assert info.value.code == pb.ErrorCode.INTERNAL and info.value.retryable
        checks = client.calls.count("Health")
        await trio.sleep(60)
        # retried with backoff, never more often than every reconnect_max once backed off
        assert client.calls.count("Health") - checks <= 60 / cfg.reconnect_max
        down["now"] = False
        t1 = trio.current_time()
        await sidecar.changes().wait()
        assert trio.current_time() - t1 <= 2 * cfg.reconnect_max
        assert sidecar.not_ready_reason() is None and sidecar.supervisor.engine_reachable.is_open
        nursery.cancel_scope.cancel()
    assert client.calls.count("GetServerInfo") == 2  # rediscovered once, when back


async def test_a_stream_losing_the_engine_ends_failed_and_triggers_a_check_at_once(
    autojump_clock: Any,
) -> None:
    async def lost_mid_stream(request: pb.GenerateRequest, send: Any) -> None:
        await send.send(
            pb.GenerateResponse(request_id=request.request_id, token=pb.TokenOutput(output_index=0))
        )
        await trio.sleep(1.0)
        raise EngineUnavailable("Generate: engine unreachable or connection lost")

    client = FakeEngine(vllm_info(), script=lost_mid_stream)
    sidecar = sidecar_with(client)
    sidecar.config.health_interval = 1000.0  # only the stream's failure can bring the next check
    await sidecar.startup()
    checked = trio.Event()

    async def health() -> pb.HealthResponse:
        checked.set()
        return pb.HealthResponse(state=pb.HealthState.READY)

    client.health_script = health
    async with trio.open_nursery() as nursery:
        await nursery.start(sidecar.supervisor.run_service)
        await nursery.start(sidecar.watch_engine)
        t0 = trio.current_time()
        handle = sidecar.admit(pb.GenerateRequest(request_id="a", model="llama", prompt="hi"), {})

        async def emit(ev: pb.GenerateResponse) -> None:
            pass

        outcome = await sidecar.run_stream(handle, emit)
        assert trio.current_time() - t0 == pytest.approx(1.0)  # at the loss, not later
        await checked.wait()
        assert trio.current_time() - t0 == pytest.approx(1.0)  # checked at once
        nursery.cancel_scope.cancel()
    assert outcome.kind == FAILED and outcome.retryable and outcome.code == pb.ErrorCode.INTERNAL
    assert "Abort:a" in client.calls  # no terminal event: the engine is told


async def test_engine_watch_refuses_a_changed_engine(autojump_clock: Any) -> None:
    client, sidecar, down = await refusable_engine()
    async with trio.open_nursery() as nursery:
        await nursery.start(sidecar.watch_engine)
        down["now"] = True
        await sidecar.changes().wait()
        client.info, client.models = vllm_info(dp=2)  # back with another data-parallel size
        down["now"] = False
        while True:
            changed = sidecar.changes()  # taken before the state it guards is read
            reason = sidecar.not_ready_reason()
            if reason != "engine unreachable: connection refused":
                break
            await changed.wait()
        assert reason is not None and reason.startswith("engine changed since discovery")
        await trio.sleep(60)  # and stays refused
        assert sidecar.not_ready_reason() == reason
        nursery.cancel_scope.cancel()


async def test_a_stream_ending_after_the_service_stopped_still_gets_its_abort(autojump_clock: Any) -> None:
    """At the stop deadline the supervisor's service may stop before a stream reaches its
    ``finally``: the stream's Abort is then sent directly (bounded), not handed to a closed
    nursery (that raised "Nursery is closed to new arrivals" and no Abort was sent)."""
    client = FakeEngine(vllm_info(), script=tokens_every(1.0, -1))
    sidecar = sidecar_with(client)
    await sidecar.startup()
    async with trio.open_nursery() as streams:
        with trio.CancelScope() as service:
            async with trio.open_nursery() as nursery:
                await nursery.start(sidecar.supervisor.run_service)
                outcomes = await run_streams(sidecar, streams, "late")
                service.cancel()
        assert not sidecar.supervisor.sender.serving
        t0 = trio.current_time()
        sidecar.supervisor.cancel_all(Outcome(CANCELLED, pb.ErrorCode.CANCELLED, "stopping"))
    assert trio.current_time() - t0 <= ABORT
    assert outcomes["late"].kind == CANCELLED
    assert [c for c in client.calls if c.startswith("Abort")] == ["Abort:late"]
    assert len(sidecar.supervisor.aborts) == 0


async def test_a_first_abort_attempt_under_way_is_finished_when_the_service_stops(
    autojump_clock: Any,
) -> None:
    """The service stopping while a stream's first Abort attempt waits for the engine's answer
    does not cut that attempt short: it is answered (counted ``aborted``), within its bound."""
    client = FakeEngine(vllm_info(), script=tokens_every(1.0, -1))
    client.abort_delay = ABORT / 2
    sidecar = sidecar_with(client)
    await sidecar.startup()
    aborted0 = metrics.child(metrics.ABORTS, "aborted")._value.get()
    async with trio.open_nursery() as streams:
        with trio.CancelScope() as service:
            async with trio.open_nursery() as nursery:
                await nursery.start(sidecar.supervisor.run_service)
                await run_streams(sidecar, streams, "r")
                sidecar.supervisor.cancel_all(Outcome(CANCELLED, pb.ErrorCode.CANCELLED, "stopping"))
                await trio.sleep(ABORT / 4)  # the Abort is at the engine now
                assert client.calls[-1] == "Abort:r"
                service.cancel()
        took = trio.current_time()
    assert metrics.child(metrics.ABORTS, "aborted")._value.get() - aborted0 == 1
    assert took <= 2 * ABORT
