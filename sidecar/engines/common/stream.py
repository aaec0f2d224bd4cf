"""Drives one accepted request through an engine's output stream and sends its OpenEngine events.

:func:`drive` ends the request with exactly one outcome:

- completed: every output finished (the last ``GenerationFinished`` carries Usage);
- aborted: an Abort (or a drain deadline) came before the terminal: the engine is told to stop
  the request, nothing more is sent (not even outputs the engine made before the Abort and the
  client has not read yet), and every unfinished output gets ``GenerationFinished{CANCELLED}``;
- cancelled: the client reset the stream (or the server shut down): the handler sees
  ``asyncio.CancelledError`` wherever it waits; the engine is told to stop the request (a task
  that outlives the cancelled handler) and the error propagates;
- failed: the engine rejected the request before its first output (``refusal`` maps the error
  to a non-OK status: nothing was sent, the request is forgotten), or failed it later (one
  terminal ``EngineError``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from sidecar.engines.common.events import EngineFailure, StreamEvents
from sidecar.engines.common.registry import ABORTED, CANCELLED, COMPLETED, FAILED, Active, AdapterEngine
from sidecar.openengine import pb
from sidecar.openengine.serving.grpc_server import RpcStatusError

log = logging.getLogger(__name__)

Send = Callable[[Any], Awaitable[None]]


async def drive(
    engine: AdapterEngine,
    active: Active,
    send: Send,
    builder: StreamEvents,
    outputs: AsyncIterator[Any],
    *,
    convert: Callable[[Any], list[pb.GenerateResponse]],
    finished: Callable[[Any], bool],
    refusal: Callable[[BaseException], RpcStatusError | None],
    engine_name: str,
) -> None:
    """Serve ``active`` from ``outputs`` (the engine's stream for it) to its end; re-raises
    cancellation. ``convert`` turns one output into events (raising :class:`EngineFailure` for
    an engine error), ``finished`` says whether the engine is done with the request."""
    request_id = active.id

    async def emit(events: list[pb.GenerateResponse], *, terminal: bool = False) -> None:
        """Send ``events`` in order; once an Abort has come (and these are not its terminal
        events), the rest are withdrawn from ``builder`` unsent."""
        for i, event in enumerate(events):
            if active.abort_reason is not None and not terminal:
                builder.withdraw(events[i:])
                return
            try:
                await send(event)
            except asyncio.CancelledError:
                raise
            except Exception as err:  # the transport failed: the client is gone
                raise _ClientGone(f"{type(err).__name__}: {err}") from err
            active.first_event = True

    outcome = FAILED
    try:
        try:
            async for out in outputs:
                if active.abort_reason is not None:
                    # Aborted: nothing more is sent, not even what the engine made before the
                    # Abort (it may have finished the request while its events still waited for
                    # the client); it is told again in case the Abort came before it knew the request
                    if not finished(out):
                        await engine.engine_abort([request_id])
                    break
                await emit(convert(out))
            if not builder.done:
                reason = active.abort_reason or "by the engine"
                await emit(builder.cancel_rest(f"aborted ({reason})"), terminal=True)
            outcome = ABORTED if active.abort_reason is not None else COMPLETED
        except (asyncio.CancelledError, GeneratorExit):
            outcome = CANCELLED
            raise
        except _ClientGone as gone:
            log.info("request %s: client gone while sending (%s)", request_id, gone)
            outcome = CANCELLED
        except EngineFailure as err:
            await emit([builder.error(pb.ErrorCode.INTERNAL, str(err), retryable=True)], terminal=True)
        except Exception as err:
            status = refusal(err.__cause__ or err)
            if not active.first_event and status is not None:
                engine.forget(active)
                raise status from None
            log.exception("request %s failed inside %s", request_id, engine_name)
            if not builder.done:
                await emit(
                    [builder.error(pb.ErrorCode.INTERNAL, f"{engine_name}: {err}", retryable=True)],
                    terminal=True,
                )
    finally:
        if outcome == CANCELLED or not builder.done:
            engine.spawn(engine.engine_abort([request_id]))  # idempotent; survives the cancelled handler
        aclose = getattr(outputs, "aclose", None)
        if aclose is not None:
            engine.spawn(aclose())
        engine.finish(active, outcome)


class _ClientGone(Exception):
    """Sending an event failed at the transport."""
