"""``Control.Drain`` of the simulated engines.

``STARTED`` first, ``IN_PROGRESS`` whenever the in-flight count or open KV sessions
change (at most every 50 ms, and at least once a second), then ``COMPLETE`` when no
request is in flight and no KV session is held. Counts are always present.

- ``stop_accepting_new_requests``: Health turns DRAINING and new Generate calls are
  refused (``UNAVAILABLE``) from then on; it never turns back.
- ``deadline_ms`` absent: wait as long as it takes; ``0``: the deadline is now.
- At the deadline, ``abort_after_deadline`` aborts every request and KV session
  (their streams end CANCELLED) and the drain completes once they are gone;
  without it the drain completes at once, reporting what is still in flight.
- ``--fault no-drain``: ``UNIMPLEMENTED``.
- Contract-violation faults: ``drain-keeps-accepting`` (ignores
  ``stop_accepting_new_requests``), ``drain-ignores-deadline`` (ignores ``deadline_ms``),
  ``drain-early-complete`` (without a deadline: COMPLETE right after STARTED),
  ``drain-event-after-complete`` (one more IN_PROGRESS after COMPLETE), ``drain-empty-event``
  (a response with no event after STARTED), ``drain-no-complete`` (without a deadline: the
  stream closes OK where COMPLETE belongs).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from sidecar.mock import schemas
from sidecar.mock.engine import MockEngine
from sidecar.mock.validation import RequestRefused
from sidecar.openengine import pb

_MIN_INTERVAL = 0.05
_HEARTBEAT = 1.0
_ABORT_GRACE = 5.0


def _state(engine: MockEngine, state: pb.DrainState, message: str = "") -> pb.DrainResponse:
    return pb.DrainResponse(
        state=state,
        in_flight_requests=engine.in_flight,
        open_kv_sessions=engine.open_sessions,
        message=message,
    )


async def drain(engine: MockEngine, request: pb.DrainRequest) -> AsyncIterator[pb.DrainResponse]:
    """The Drain stream (an async generator; refusals raise :class:`RequestRefused` before the first event)."""
    faults = engine.config.faults
    async for response in _drain(engine, request):
        if response.state == pb.DrainState.COMPLETE:
            if faults.has("drain-no-complete") and request.deadline_ms is None:
                return
            yield response
            if faults.has("drain-event-after-complete"):
                yield _state(engine, pb.DrainState.IN_PROGRESS, "after COMPLETE (fault)")
            return
        yield response
        if response.state == pb.DrainState.STARTED and faults.has("drain-empty-event"):
            yield pb.DrainResponse()


async def _drain(engine: MockEngine, request: pb.DrainRequest) -> AsyncIterator[pb.DrainResponse]:
    if engine.config.faults.no_drain:
        raise RequestRefused("UNIMPLEMENTED", "Drain is not implemented by this engine (fault no-drain)")
    if not schemas.has(engine.config, "drain"):
        raise RequestRefused("UNIMPLEMENTED", f"Drain is not part of schema {engine.config.schema}")
    loop = asyncio.get_running_loop()
    faults = engine.config.faults
    if request.stop_accepting_new_requests and not faults.has("drain-keeps-accepting"):
        engine.draining = True
    deadline = None if request.deadline_ms is None else loop.time() + request.deadline_ms / 1000.0
    if faults.has("drain-ignores-deadline"):
        deadline = None
    yield _state(engine, pb.DrainState.STARTED, "drain started")
    if faults.has("drain-early-complete") and deadline is None:
        yield _state(engine, pb.DrainState.COMPLETE, "drained (fault: work still in flight)")
        return
    last = (engine.in_flight, engine.open_sessions)
    last_sent = loop.time()
    aborted = False
    while engine.in_flight or engine.open_sessions:
        now = loop.time()
        if deadline is not None and now >= deadline:
            if not request.abort_after_deadline:
                yield _state(engine, pb.DrainState.COMPLETE, "deadline reached; requests still in flight")
                return
            if not aborted:
                aborted = True
                engine.abort_everything("drain deadline")
                deadline = now + _ABORT_GRACE
                continue
            yield _state(
                engine, pb.DrainState.COMPLETE, "deadline reached; aborted requests did not end in time"
            )
            return
        engine.changed.clear()
        timeout = _HEARTBEAT if deadline is None else max(0.0, min(_HEARTBEAT, deadline - now))
        try:
            async with asyncio.timeout(timeout):
                await engine.changed.wait()
        except TimeoutError:
            pass
        current = (engine.in_flight, engine.open_sessions)
        now = loop.time()
        if (current != last and now - last_sent >= _MIN_INTERVAL) or now - last_sent >= _HEARTBEAT:
            last, last_sent = current, now
            yield _state(engine, pb.DrainState.IN_PROGRESS)
    yield _state(
        engine, pb.DrainState.COMPLETE, "aborted in-flight work at the deadline" if aborted else "drained"
    )
