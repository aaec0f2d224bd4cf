"""Undelivered Aborts (sidecar/core/abort_ledger.py, sidecar/core/lifecycle.py) against a real grpclib engine over
loopback: kept after the retry window, bounded (the oldest dropped, counted, its id free
again), re-sent once the engine answers, held while the engine watch says it is lost."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import trio

from sidecar.core.abort_ledger import REDELIVER_MAX_PAUSE
from sidecar.core.errors import Rejection
from sidecar.core.lifecycle import LifecycleConfig, StreamSupervisor
from sidecar.metrics_registry import REGISTRY
from sidecar.openengine import pb
from sidecar.openengine.client import open_engine_client
from tests.openengine.fake_grpc_engine import Gate, RunningServer, Status, status
from tests.polling import eventually


@pytest.fixture
async def supervisor(server: RunningServer) -> AsyncIterator[StreamSupervisor]:
    # no retry window: an unanswered first attempt is kept at once; room for two
    config = LifecycleConfig(abort_timeout=0.5, abort_retry_window=0.0, max_undelivered_aborts=2)
    async with open_engine_client(server.address) as client, trio.open_nursery() as nursery:
        sup = StreamSupervisor(client, config)
        await nursery.start(sup.run_service)
        yield sup
        nursery.cancel_scope.cancel()


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


class Engine:
    """Abort gets no answer (out of reach: the sidecar's ``abort_timeout`` ends each call)
    until :meth:`reachable`; records every call."""

    def __init__(self, server: RunningServer) -> None:
        self.up = False
        self.calls: list[str] = []
        self.gate = Gate()
        self.held: list[Any] = []
        server.engine.unary["Abort"] = self.abort

    def abort(self, r: Any) -> Any:
        if any(r is held for held in self.held):  # a held call let go: not a new call
            return pb.AbortResponse(status=pb.AbortStatus.ABORTED)
        self.calls.append(r.request_id)
        if self.up:
            return pb.AbortResponse(status=pb.AbortStatus.ABORTED)
        self.held.append(r)
        return self.gate

    def reachable(self) -> None:
        self.up = True
        self.gate.event.set()


def request(rid: str) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=rid, model="m", prompt="hi")


async def test_kept_bounded_oldest_dropped_then_resent(
    server: RunningServer, supervisor: StreamSupervisor
) -> None:
    engine = Engine(server)
    dropped0 = sample("openengine_sidecar_aborts_total", result="dropped")
    parked0 = sample("openengine_sidecar_aborts_parked_total")
    aborted0 = sample("openengine_sidecar_aborts_total", result="aborted")
    with trio.fail_after(25):
        for rid in ("a", "b", "c"):
            await supervisor.abort(rid)
            await eventually(lambda rid=rid: rid in supervisor.aborts.backlog())  # type: ignore[misc]
        assert supervisor.aborts.backlog() == ["b", "c"]
        assert sample("openengine_sidecar_aborts_total", result="dropped") - dropped0 == 1
        assert sample("openengine_sidecar_aborts_parked_total") - parked0 == 3
        assert sample("openengine_sidecar_aborts_undelivered") == 2
        # dropped: its id is free again (once a re-send of it that may be in flight is over)
        await eventually(lambda: "a" not in supervisor.aborts, timeout=2)
        supervisor.admit(request("a"))
        with pytest.raises(Rejection) as owed:
            supervisor.admit(request("b"))  # still owed: a late Abort would end a new stream
        assert owed.value.code == pb.ErrorCode.DUPLICATE_REQUEST and owed.value.retryable
        engine.reachable()
        await eventually(lambda: not supervisor.aborts.backlog(), timeout=REDELIVER_MAX_PAUSE + 5)
    # each first attempt got no answer: what delivered them is a later call, made from the backlog
    assert engine.calls.count("b") >= 2 and engine.calls.count("c") >= 2, engine.calls
    # b and c; a too when a re-send of it was under way as it was dropped (then answered)
    assert sample("openengine_sidecar_aborts_total", result="aborted") - aborted0 in (2, 3)
    assert sample("openengine_sidecar_aborts_undelivered") == 0
    assert len(supervisor.aborts) == 0  # "a" is the admitted stream's id now
    supervisor.admit(request("b"))


async def test_nothing_sent_while_the_engine_is_lost_and_sent_when_found_back(
    server: RunningServer, supervisor: StreamSupervisor
) -> None:
    engine = Engine(server)
    with trio.fail_after(10):
        supervisor.engine_reachable.close()  # the engine watch: lost
        await supervisor.abort("x")  # the immediate attempt is made (and fails): kept
        await eventually(lambda: "x" in supervisor.aborts.backlog())
        engine.reachable()
        await trio.sleep(6)  # longer than any re-delivery pause (what is proved: nothing sent)
        assert engine.calls == ["x"] and "x" in supervisor.aborts.backlog()
        t0 = trio.current_time()
        supervisor.engine_reachable.open()  # found back: re-sent at once, no pause
        await eventually(lambda: "x" not in supervisor.aborts.backlog())
        assert trio.current_time() - t0 < 1.0
    assert engine.calls == ["x", "x"]


async def test_an_engine_that_answers_but_refuses_is_given_up_on(
    server: RunningServer, supervisor: StreamSupervisor
) -> None:
    """UNAVAILABLE from the engine itself is an answer: it is there and refuses; the Abort is
    given up at the window (counted failed), not kept."""
    calls = []

    def abort(r: Any) -> Any:
        calls.append(r.request_id)
        raise status(Status.UNAVAILABLE, "busy")

    server.engine.unary["Abort"] = abort
    failed0 = sample("openengine_sidecar_aborts_total", result="failed")
    with trio.fail_after(5):
        await supervisor.abort("z")
        await eventually(lambda: "z" not in supervisor.aborts)
    assert calls == ["z"] and "z" not in supervisor.aborts.backlog()
    assert sample("openengine_sidecar_aborts_total", result="failed") - failed0 == 1
