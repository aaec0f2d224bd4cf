"""Stream lifecycle against a real grpclib engine over loopback: outcomes and Abort rules."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import Any

import pytest
import trio
import trio_asyncio

from sidecar.core.abort_ledger import AbortState
from sidecar.core.errors import Rejection
from sidecar.core.handoff import parse_kv_session
from sidecar.core.lifecycle import (
    CANCELLED,
    COMPLETED,
    FAILED,
    OUTCOME_CLIENT_CANCELLED,
    REJECTED,
    ClientGone,
    LifecycleConfig,
    StreamSupervisor,
)
from sidecar.metrics_registry import REGISTRY
from sidecar.openengine import pb
from sidecar.openengine.client import open_engine_client
from tests.openengine.fake_grpc_engine import Gate, RunningServer, Status, status, tokens
from tests.polling import eventually


@pytest.fixture
async def supervisor(server: RunningServer) -> AsyncIterator[StreamSupervisor]:
    async with open_engine_client(server.address) as client, trio.open_nursery() as nursery:
        sup = StreamSupervisor(client, LifecycleConfig(abort_timeout=1.0, abort_retry_window=2.0))
        await nursery.start(sup.run_service)
        yield sup
        nursery.cancel_scope.cancel()


def aborts(server: RunningServer) -> list[str]:
    return [s.request.request_id for s in server.engine.seen if s.route == "Abort"]


def request(rid: str = "r1") -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=rid, model="m", prompt="hi")


class Sink:
    def __init__(self, *, gone_after: int | None = None) -> None:
        self.events: list[pb.GenerateResponse] = []
        self.gone_after = gone_after

    async def __call__(self, ev: pb.GenerateResponse) -> None:
        if self.gone_after is not None and len(self.events) >= self.gone_after:
            raise ClientGone
        self.events.append(ev)


async def test_completed_stream_sends_no_abort(server: RunningServer, supervisor: StreamSupervisor) -> None:
    server.engine.streams["Generate"] = lambda r, md: tokens(r.request_id, 3)
    sink = Sink()
    with trio.fail_after(5):
        outcome = await supervisor.run(supervisor.admit(request()), sink)
    assert outcome.kind == COMPLETED and outcome.code is None
    assert len(sink.events) == 4
    assert aborts(server) == []
    assert supervisor.streams == {}


async def test_cancel_closes_upstream_then_aborts_once(
    server: RunningServer, supervisor: StreamSupervisor
) -> None:
    gate = Gate()
    server.engine.streams["Generate"] = lambda r, md: [tokens(r.request_id, 1)[0], gate]
    got_one = trio.Event()

    async def emit(ev: pb.GenerateResponse) -> None:
        got_one.set()

    with trio.fail_after(5):
        handle = supervisor.admit(request())
        async with trio.open_nursery() as nursery:
            result: list[Any] = []

            async def run() -> None:
                result.append(await supervisor.run(handle, emit))

            nursery.start_soon(run)
            await got_one.wait()
            handle.cancel(OUTCOME_CLIENT_CANCELLED)
    assert result[0] == OUTCOME_CLIENT_CANCELLED
    gen = next(s for s in server.engine.seen if s.route == "Generate")
    assert gen.cancelled.is_set()  # upstream closed before the Abort was sent
    assert aborts(server) == ["r1"]


async def test_engine_error_is_relayed_and_not_aborted(
    server: RunningServer, supervisor: StreamSupervisor
) -> None:
    err = pb.EngineError(code=pb.ErrorCode.KV_TRANSFER_FAILED, message="x", retryable=True)
    server.engine.streams["Generate"] = lambda r, md: [
        pb.GenerateResponse(request_id=r.request_id, error=err)
    ]
    sink = Sink()
    with trio.fail_after(5):
        outcome = await supervisor.run(supervisor.admit(request()), sink)
    assert (outcome.kind, outcome.code, outcome.retryable) == (FAILED, pb.ErrorCode.KV_TRANSFER_FAILED, True)
    assert sink.events[-1].error == err
    assert aborts(server) == []


async def test_status_before_acceptance_is_rejected_without_abort(
    server: RunningServer, supervisor: StreamSupervisor
) -> None:
    server.engine.streams["Generate"] = lambda r, md: [status(Status.INVALID_ARGUMENT, "bad")]
    with trio.fail_after(5):
        outcome = await supervisor.run(supervisor.admit(request()), Sink())
    assert (outcome.kind, outcome.code) == (REJECTED, pb.ErrorCode.INVALID_ARGUMENT)
    assert aborts(server) == []


async def test_protocol_violation_fails_and_aborts(
    server: RunningServer, supervisor: StreamSupervisor
) -> None:
    server.engine.streams["Generate"] = lambda r, md: tokens(r.request_id, 2)[:2]  # closes without terminal
    with trio.fail_after(5):
        outcome = await supervisor.run(supervisor.admit(request()), Sink())
    assert outcome.kind == FAILED and "without a terminal" in outcome.message
    assert aborts(server) == ["r1"]


async def test_client_gone_cancels_and_aborts(server: RunningServer, supervisor: StreamSupervisor) -> None:
    gate = Gate()
    server.engine.streams["Generate"] = lambda r, md: [*tokens(r.request_id, 3)[:3], gate]
    with trio.fail_after(5):
        outcome = await supervisor.run(supervisor.admit(request()), Sink(gone_after=1))
    assert outcome.kind == CANCELLED
    assert aborts(server) == ["r1"]


async def test_inactivity_timeout(server: RunningServer, supervisor: StreamSupervisor) -> None:
    supervisor.config.inactivity_timeout = 0.2
    gate = Gate()
    server.engine.streams["Generate"] = lambda r, md: [tokens(r.request_id, 1)[0], gate]
    with trio.fail_after(5):
        outcome = await supervisor.run(supervisor.admit(request()), Sink())
    assert outcome.kind == FAILED and outcome.retryable and "no event" in outcome.message
    assert aborts(server) == ["r1"]


class SlowSink(Sink):
    """A client that takes ``delay`` seconds to take each event (the scenario, not a sync)."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay

    async def __call__(self, ev: pb.GenerateResponse) -> None:
        await trio.sleep(self.delay)
        await super().__call__(ev)


async def test_inactivity_timeout_counts_waits_for_the_engine_not_a_slow_client(
    server: RunningServer,
) -> None:
    """Events that arrived together, each taking the client longer than the inactivity timeout
    to take: the stream completes (the relay lifts the deadline while it relays, and sets it
    only before waiting for the engine); once the engine then goes silent, the timeout fires."""
    config = LifecycleConfig(abort_timeout=1.0, abort_retry_window=2.0, inactivity_timeout=0.2)
    async with open_engine_client(server.address) as client:
        supervisor = StreamSupervisor(client, config)
        server.engine.streams["Generate"] = lambda r, md: tokens(r.request_id, 3)
        sink = SlowSink(0.3)
        with trio.fail_after(10):
            outcome = await supervisor.run(supervisor.admit(request("slow")), sink)
        assert outcome.kind == COMPLETED and len(sink.events) == 4

        server.engine.streams["Generate"] = lambda r, md: [*tokens(r.request_id, 3)[:2], Gate()]
        sink = SlowSink(0.3)
        with trio.fail_after(10):
            outcome = await supervisor.run(supervisor.admit(request("silent")), sink)
        assert outcome.kind == FAILED and "no event" in outcome.message and len(sink.events) == 2


async def test_inactivity_timeout_starts_after_the_first_event(
    server: RunningServer, supervisor: StreamSupervisor
) -> None:
    """A long prefill (no first event for 0.5 s) is not cut by a 0.2 s inactivity timeout; the
    first-event bound is separate."""
    supervisor.config.inactivity_timeout = 0.2
    gate = Gate()
    server.engine.streams["Generate"] = lambda r, md: [gate, *tokens(r.request_id, 3)]
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(open_gate_after, gate, 0.5)
            outcome = await supervisor.run(supervisor.admit(request()), Sink())
    assert outcome.kind == COMPLETED
    assert supervisor.progress.stalled is None


async def test_first_event_timeout(server: RunningServer, supervisor: StreamSupervisor) -> None:
    supervisor.config.first_event_timeout = 0.2
    server.engine.streams["Generate"] = lambda r, md: [Gate()]
    with trio.fail_after(5):
        outcome = await supervisor.run(supervisor.admit(request()), Sink())
    assert outcome.kind == FAILED and outcome.retryable and "no first event" in outcome.message
    assert aborts(server) == ["r1"]
    assert supervisor.progress.stalled is None  # one slow request says nothing about Generate


async def test_every_started_stream_silent_marks_generate_stalled_until_an_event(
    server: RunningServer, supervisor: StreamSupervisor
) -> None:
    """Two started streams both silent past the inactivity timeout: the Generate path is
    stalled (readiness follows ``progress.stalled``); a stream admitted meanwhile gets the
    inactivity timeout as its first-event bound; the next event clears it."""
    supervisor.config.inactivity_timeout = 0.3
    supervisor.config.first_event_timeout = 60.0
    changes: list[str | None] = []
    supervisor.progress.on_change = lambda: changes.append(supervisor.progress.stalled)
    server.engine.streams["Generate"] = lambda r, md: [tokens(r.request_id, 1)[0], Gate()]
    with trio.fail_after(10):
        outcomes: list[Any] = []

        async def run(rid: str) -> None:
            outcomes.append(await supervisor.run(supervisor.admit(request(rid)), Sink()))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, "a")
            nursery.start_soon(run, "b")
        assert [o.kind for o in outcomes] == [FAILED, FAILED]
        assert supervisor.progress.stalled is not None and changes[0] is not None
        server.engine.streams["Generate"] = lambda r, md: [Gate()]
        t0 = trio.current_time()
        late = await supervisor.run(supervisor.admit(request("c")), Sink())
        assert late.kind == FAILED and "no first event" in late.message
        assert trio.current_time() - t0 < 5  # 0.3 s, not the 60 s first-event bound
        server.engine.streams["Generate"] = lambda r, md: tokens(r.request_id, 2)
        assert (await supervisor.run(supervisor.admit(request("d")), Sink())).kind == COMPLETED
    assert supervisor.progress.stalled is None and changes[-1] is None


async def open_gate_after(gate: Gate, seconds: float) -> None:
    await trio.sleep(seconds)  # the engine's delay is the scenario, not a synchronization

    async def open_() -> None:
        gate.event.set()

    await trio_asyncio.aio_as_trio(open_)()


async def test_abort_retried_on_unavailable(server: RunningServer, supervisor: StreamSupervisor) -> None:
    calls = []

    def abort(r: Any) -> Any:
        calls.append(r.request_id)
        if len(calls) < 3:
            raise status(Status.UNAVAILABLE, "busy")
        return pb.AbortResponse(status=pb.AbortStatus.ABORTED)

    server.engine.unary["Abort"] = abort
    with trio.fail_after(5):
        await supervisor.abort("rX")
        await eventually(lambda: len(calls) >= 3)  # the retrier runs on its own schedule
    assert calls == ["rX", "rX", "rX"]


@pytest.mark.parametrize("answer", ["not_found", "already_finished"])
async def test_abort_idempotent_answers_count_as_done(
    server: RunningServer, supervisor: StreamSupervisor, answer: str
) -> None:
    calls = []

    def abort(r: Any) -> Any:
        calls.append(r.request_id)
        if answer == "not_found":
            raise status(Status.NOT_FOUND, "gone")
        return pb.AbortResponse(status=pb.AbortStatus.ALREADY_FINISHED)

    server.engine.unary["Abort"] = abort
    with trio.fail_after(5):
        await supervisor.abort("rY")
    assert calls == ["rY"]
    assert "rY" not in supervisor.aborts  # answered: no retry queued


async def test_admission_gates(supervisor: StreamSupervisor) -> None:
    supervisor.admit(request("a"))
    with pytest.raises(Rejection) as dup:
        supervisor.admit(request("a"))
    assert dup.value.code == pb.ErrorCode.DUPLICATE_REQUEST
    empty = supervisor.admit(request(""))
    assert empty.request_id.startswith("sc-")
    supervisor.config.max_streams = 2
    with pytest.raises(Rejection) as full:
        supervisor.admit(request("b"))
    assert full.value.code == pb.ErrorCode.OVERLOADED and full.value.retryable
    supervisor.start_draining()
    with pytest.raises(Rejection) as draining:
        supervisor.admit(request("c"))
    assert draining.value.code == pb.ErrorCode.DRAINING and draining.value.retryable


async def test_admit_sends_the_client_session_bytes_verbatim(supervisor: StreamSupervisor) -> None:
    """The engine gets a client's KvSessionRef bytes as sent (a newer revision's field kept), in
    the request the handle holds from admission on, its id filled by the supervisor."""
    raw = bytes(pb.KvSessionRef(session_id="s1", dp_rank=0)) + b"\xa8\x06\x01"  # field 101: varint 1
    req = request("")
    req.kv = pb.KvOptions(session=parse_kv_session(raw), cache_salt="salt")
    handle = supervisor.admit(req, kv_session_bytes=raw)
    sent = bytes(handle.request)
    assert raw in sent and handle.request_id.startswith("sc-")
    parsed = pb.GenerateRequest.parse(sent)
    assert parsed.request_id == handle.request_id and parsed.kv is not None and parsed.kv.cache_salt == "salt"
    assert supervisor.admit(request("plain")).request.kv is None


async def test_aborts_in_flight_are_bounded(server: RunningServer, supervisor: StreamSupervisor) -> None:
    """A mass disconnect queues its Aborts: at most max_concurrent_aborts reach the engine at once."""
    supervisor.sender._abort_slots.total_tokens = 2
    gate = Gate()
    in_flight = 0
    peak = 0

    def abort(r: Any) -> Any:
        nonlocal in_flight, peak
        if r.request_id.startswith("done:"):
            in_flight -= 1
            return pb.AbortResponse(status=pb.AbortStatus.ABORTED)
        in_flight += 1
        peak = max(peak, in_flight)
        r.request_id = "done:" + r.request_id  # the second call of this handler (after the gate) returns
        return gate

    server.engine.unary["Abort"] = abort
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            for i in range(6):
                nursery.start_soon(supervisor.abort, f"m{i}")
            await eventually(lambda: len([s for s in server.engine.seen if s.route == "Abort"]) >= 2)
            assert peak == 2
            gate.event.set()
    assert peak == 2
    assert len([s for s in server.engine.seen if s.route == "Abort"]) == 6


async def test_token_metrics_added_in_bulk_and_itl_sampled(
    server: RunningServer, supervisor: StreamSupervisor
) -> None:
    """TOKENS is exact once the stream ends (added every TOKENS_FLUSH and at the end); TTFT is
    observed once; ITL on the first gap, then one gap in ITL_SAMPLE."""
    from sidecar.core import metrics
    from sidecar.metrics_registry import REGISTRY

    def value(name: str) -> float:
        return REGISTRY.get_sample_value(name) or 0.0

    n = 150
    server.engine.streams["Generate"] = lambda r, md: tokens(r.request_id, n)
    before = [
        value(x)
        for x in (
            "openengine_sidecar_tokens_relayed_total",
            "openengine_sidecar_time_to_first_token_seconds_count",
            "openengine_sidecar_inter_token_seconds_count",
        )
    ]
    with trio.fail_after(5):
        outcome = await supervisor.run(supervisor.admit(request("bulk")), Sink())
    assert outcome.kind == COMPLETED
    after = [
        value(x)
        for x in (
            "openengine_sidecar_tokens_relayed_total",
            "openengine_sidecar_time_to_first_token_seconds_count",
            "openengine_sidecar_inter_token_seconds_count",
        )
    ]
    assert after[0] - before[0] == n
    assert after[1] - before[1] == 1
    assert after[2] - before[2] == 1 + (n - 1) // metrics.ITL_SAMPLE


async def test_queued_abort_is_not_counted_as_a_retry(
    server: RunningServer, supervisor: StreamSupervisor
) -> None:
    """An Abort that waited abort_timeout for a slot (a mass disconnect's queue) goes to the
    background retrier, which sends it once a slot frees: not counted in abort_retries."""
    from sidecar.metrics_registry import REGISTRY

    supervisor.sender._abort_slots.total_tokens = 1
    supervisor.config.abort_timeout = 0.2
    holder = object()
    await supervisor.sender._abort_slots.acquire_on_behalf_of(holder)  # every slot busy
    retries_before = REGISTRY.get_sample_value("openengine_sidecar_abort_retries_total") or 0.0
    with trio.fail_after(10):
        await supervisor.abort("queued")  # no slot within abort_timeout: handed off
        assert aborts(server) == []
        supervisor.sender._abort_slots.release_on_behalf_of(holder)
        await eventually(lambda: aborts(server))  # the engine is in another event loop
    assert aborts(server) == ["queued"]
    retries = (REGISTRY.get_sample_value("openengine_sidecar_abort_retries_total") or 0.0) - retries_before
    assert retries == 0


async def test_sidecar_made_ids_are_random_and_never_collide(
    supervisor: StreamSupervisor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 15: no counter a client could guess, and a made id is never one in flight (a
    client that took it first keeps its stream; both stay counted)."""
    made = {supervisor.admit(request("")).request_id for _ in range(50)}
    assert len(made) == 50 and all(re.fullmatch(r"sc-[0-9a-f]{32}", rid) for rid in made)
    claimed = supervisor.admit(request("sc-" + "a" * 32))
    draws = iter(["a" * 32, "a" * 32, "b" * 32])
    monkeypatch.setattr("sidecar.core.lifecycle.secrets.token_hex", lambda n: next(draws))
    fresh = supervisor.admit(request(""))
    assert fresh.request_id == "sc-" + "b" * 32
    assert supervisor.streams[claimed.request_id] is claimed and supervisor.streams[fresh.request_id] is fresh
    assert len(supervisor.streams) == 52


async def test_request_id_length_is_bounded(supervisor: StreamSupervisor) -> None:
    limit = supervisor.config.max_request_id_length
    supervisor.admit(request("x" * limit))
    with pytest.raises(Rejection) as long:
        supervisor.admit(request("y" * (limit + 1) * 4096))
    assert long.value.code == pb.ErrorCode.INVALID_ARGUMENT and str(limit) in long.value.message
    assert len(long.value.message) < 100


async def test_an_id_still_being_aborted_is_not_admitted_again(
    server: RunningServer, supervisor: StreamSupervisor
) -> None:
    """A late retried Abort would end a new stream that reused the id: refused (retryable)
    until the Abort is done."""
    release = trio.Event()
    answers: list[str] = []

    def abort(r: Any) -> Any:
        answers.append(r.request_id)
        if not release.is_set():
            raise status(Status.UNAVAILABLE, "busy")
        return pb.AbortResponse(status=pb.AbortStatus.ABORTED)

    server.engine.unary["Abort"] = abort
    with trio.fail_after(5):
        await supervisor.abort("again")  # first attempt fails: retried in the background
        with pytest.raises(Rejection) as busy:
            supervisor.admit(request("again"))
        assert busy.value.code == pb.ErrorCode.DUPLICATE_REQUEST and busy.value.retryable
        release.set()
        await eventually(lambda: "again" not in supervisor.aborts)
    supervisor.admit(request("again"))


def _confirmations(result: str) -> float:
    return (
        REGISTRY.get_sample_value("openengine_sidecar_abort_confirmations_total", {"result": result}) or 0.0
    )


async def _cancel_silent_stream(
    server: RunningServer, supervisor: StreamSupervisor, rid: str, *, tokens_first: int = 0
) -> None:
    """Run a stream whose engine sends ``tokens_first`` tokens, then nothing; cancel it once
    the engine has it (and the client its tokens); return after its Abort's first answer."""
    gate = Gate()
    server.engine.streams["Generate"] = lambda r, md: [
        *tokens(r.request_id, tokens_first)[:tokens_first],
        gate,
    ]
    sink = Sink()
    handle = supervisor.admit(request(rid))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(supervisor.run, handle, sink)
        await eventually(
            lambda: (
                any(s.route == "Generate" for s in server.engine.seen) and len(sink.events) >= tokens_first
            )
        )
        handle.cancel(OUTCOME_CLIENT_CANCELLED)


async def test_a_not_found_abort_of_a_stream_the_engine_sent_nothing_on_is_confirmed(
    server: RunningServer,
) -> None:
    """The Abort may overtake its request (another connection; a retransmission after a
    partition): NOT_FOUND for a stream the engine never answered is sent again after each
    pause of abort_confirm_after until one finds it; the id stays reserved meanwhile."""
    answers = ["NOT_FOUND", "NOT_FOUND", "ABORTED"]  # found on the second confirmation
    calls: list[str] = []

    def abort(r: Any) -> Any:
        calls.append(r.request_id)
        if answers[min(len(calls), len(answers)) - 1] == "NOT_FOUND":
            raise status(Status.NOT_FOUND, "no such request (yet)")
        return pb.AbortResponse(status=pb.AbortStatus.ABORTED)

    server.engine.unary["Abort"] = abort
    found_before = _confirmations("aborted")
    config = LifecycleConfig(abort_timeout=1.0, abort_retry_window=2.0, abort_confirm_after=(0.2, 0.3, 0.3))
    async with open_engine_client(server.address) as client, trio.open_nursery() as nursery:
        sup = StreamSupervisor(client, config)
        await nursery.start(sup.run_service)
        with trio.fail_after(5):
            await _cancel_silent_stream(server, sup, "late")
            assert calls == ["late"]
            with pytest.raises(Rejection) as busy:  # a confirmation must not end a new "late"
                sup.admit(request("late"))
            assert busy.value.code == pb.ErrorCode.DUPLICATE_REQUEST and busy.value.retryable
            assert sup.aborts.state("late") is AbortState.CONFIRMING
            await eventually(lambda: "late" not in sup.aborts)
        assert calls == ["late"] * 3  # the third confirmation was not needed
        assert _confirmations("aborted") == found_before + 1
        sup.admit(request("late"))
        nursery.cancel_scope.cancel()


async def test_a_not_found_abort_is_confirmed_only_while_the_engine_may_not_have_the_request(
    server: RunningServer,
) -> None:
    """NOT_FOUND for a stream the engine sent a token on is final (the engine had it); NOT_FOUND
    on every confirmation: the id is freed after the last one."""
    calls: list[str] = []

    def abort(r: Any) -> Any:
        calls.append(r.request_id)
        raise status(Status.NOT_FOUND, "gone")

    server.engine.unary["Abort"] = abort
    config = LifecycleConfig(abort_timeout=1.0, abort_retry_window=2.0, abort_confirm_after=(0.1, 0.1))
    async with open_engine_client(server.address) as client, trio.open_nursery() as nursery:
        sup = StreamSupervisor(client, config)
        await nursery.start(sup.run_service)
        with trio.fail_after(5):
            await _cancel_silent_stream(server, sup, "answered", tokens_first=1)
            assert calls == ["answered"]
            assert "answered" not in sup.aborts  # done: nothing to confirm
            server.engine.seen.clear()
            await _cancel_silent_stream(server, sup, "silent")
            await eventually(lambda: "silent" not in sup.aborts)
        assert calls == ["answered", "silent", "silent", "silent"]
        assert len(sup.aborts) == 0
        nursery.cancel_scope.cancel()


async def test_stream_log_fields_and_active_streams_while_it_runs(
    server: RunningServer, supervisor: StreamSupervisor
) -> None:
    """While a stream is relayed its log records carry the request id and the fields its plane
    gave (``StreamHandle.log_fields``: the WebSocket stream number), and ``active_streams``
    counts it; after it, neither."""
    import logging

    from sidecar.logs import _ContextFilter

    seen: list[tuple[object, object, float | None]] = []

    async def emit(ev: pb.GenerateResponse) -> None:
        record = logging.getLogger("t").makeRecord("t", logging.INFO, __file__, 1, "m", (), None)
        _ContextFilter().filter(record)
        active = REGISTRY.get_sample_value("openengine_sidecar_active_streams")
        seen.append((getattr(record, "request_id", None), getattr(record, "stream", None), active))

    server.engine.streams["Generate"] = lambda r, md: tokens(r.request_id, 2)
    handle = supervisor.admit(request("r-log"))
    handle.log_fields = {"stream": 7}
    with trio.fail_after(5):
        outcome = await supervisor.run(handle, emit)
    assert outcome.kind == COMPLETED and seen
    assert set(seen) == {("r-log", 7, 1.0)}
    assert REGISTRY.get_sample_value("openengine_sidecar_active_streams") == 0.0
