"""One Dynamo request ↔ one admitted stream: the bridge between Dynamo's handler and trio.

Dynamo's runtime calls the endpoint handler — an asyncio async generator — on the
trio-asyncio loop, and pulls one chunk per ``__anext__``. The stream itself is a trio task
owned by the plane's stream nursery and runs the SAME admission and lifecycle as the
WebSocket plane (``Sidecar.admit`` / ``Sidecar.run_stream``):

    Dynamo ──handler(request, context)──▶ job ──start_soon──▶ stream task (trio)
           ◀──yield chunk── bounded trio channel ◀──emit(event)──┘  (+ Job.wake)

- The handler starts the job's trio task itself (a synchronous ``start_soon`` into the
  bridge's stream nursery, run in the bridge's own context: the handler's asyncio context
  lacks trio-asyncio's current loop) and reads the channel: ``receive_nowait`` while chunks
  are queued (several queued token chunks of one output are merged into one), else it
  awaits a plain asyncio future that the stream task resolves right after it queues a chunk
  or closes the channel (:meth:`Job.wake`). No trio task, timer or extra hop stands between
  an engine event and the handler's ``yield``: the first chunk is one asyncio callback away
  (``tests/dynamo/test_handler.py`` counts the scheduler passes). The bridge also makes the
  loop run its queued callbacks in batches (``aio_batch``).
- Cancellation: Dynamo does not cancel the handler when the HTTP client goes away; it
  stops or kills the request ``context``. The stream task watches
  ``context.async_killed_or_stopped()`` in its own nursery and cancels the stream — the
  lifecycle then closes the upstream and sends ``Abort``. If Dynamo closes the generator
  instead, its ``finally`` cancels the stream the same way — handed to trio thread-safely
  (``TrioToken.run_sync_soon``), since the runtime may close it from its own thread or loop,
  and garbage collection from anywhere.
- A stream that did not complete ends with a ``dynamo.llm.exceptions`` error
  (``mapping.error_kind``): 400-class for client errors, retryable kinds for draining or
  engine loss, nothing when Dynamo itself stopped the request.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import AsyncIterator
from typing import Any

import trio
import trio_asyncio

from sidecar.core.errors import Rejection
from sidecar.core.lifecycle import CANCELLED, ClientGone, Outcome
from sidecar.dynamo import metrics
from sidecar.dynamo.aio_batch import batch_ready_callbacks
from sidecar.dynamo.mapping import ChunkMerger, chunk_of, error_kind, to_generate_request
from sidecar.openengine import pb

log = logging.getLogger(__name__)

OUTCOME_DYNAMO_STOPPED = Outcome(CANCELLED, pb.ErrorCode.CANCELLED, "Dynamo stopped the request")
OUTCOME_HANDLER_CLOSED = Outcome(CANCELLED, pb.ErrorCode.CANCELLED, "Dynamo closed the response stream")
#: Chunks buffered per stream before the engine is pushed back.
CHUNK_BUFFER = 64


class _Raise:
    """End of a stream that must surface as an exception in Dynamo."""

    __slots__ = ("kind", "message")

    def __init__(self, kind: str, message: str) -> None:
        self.kind = kind
        self.message = message


class Job:
    """One Dynamo request on its way to (and through) the stream lifecycle."""

    __slots__ = ("abandoned", "context", "handle", "request", "send", "stopped", "waiter")

    def __init__(self, request: Any, context: Any, stopped: Any, send: trio.MemorySendChannel[Any]) -> None:
        self.request = request
        self.context = context
        #: asyncio future resolved when Dynamo stops or kills the request (``None`` in tests).
        self.stopped = stopped
        self.send = send
        self.handle: Any = None
        self.abandoned = False
        #: The handler's asyncio future while it waits for a chunk (``None``: not waiting).
        self.waiter: asyncio.Future[None] | None = None

    def wake(self) -> None:
        """A chunk was queued or the channel closed: resume the waiting handler (synchronous;
        the handler's task runs at the loop's next callback)."""
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def abandon(self) -> None:
        """The handler is gone: cancel the stream (idempotent, synchronous)."""
        self.abandoned = True
        if self.handle is not None:
            self.handle.cancel(OUTCOME_HANDLER_CLOSED)


def _exception(item: _Raise) -> BaseException:
    try:
        from dynamo.llm import exceptions
    except ImportError:  # pragma: no cover - only without the extra (unit tests)
        return RuntimeError(f"{item.kind}: {item.message}")
    cls = getattr(exceptions, item.kind, None) or exceptions.Unknown
    error: BaseException = cls(item.message)
    return error


class StreamBridge:
    """Serves Dynamo requests through a :class:`~sidecar.core.sidecar.Sidecar`.

    ``handler`` is the Dynamo endpoint handler (asyncio-flavoured); :meth:`run` is the trio
    service that owns the streams (start it in the plane's nursery before serving).
    """

    def __init__(self, sidecar: Any, loop: Any = None, *, buffer: int = CHUNK_BUFFER) -> None:
        self.sidecar = sidecar
        self.loop = loop
        self.buffer = buffer
        self.active = 0
        self._nursery: trio.Nursery | None = None
        self._context: contextvars.Context | None = None
        self._token: trio.lowlevel.TrioToken | None = None

    # -- trio side ---------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Own the stream tasks (:meth:`submit` starts one per job) until cancelled; then every
        stream is cancelled and no job is accepted any more."""
        if self.loop is not None:
            batch_ready_callbacks(self.loop)
        async with trio.open_nursery() as nursery:
            self._context = contextvars.copy_context()
            self._token = trio.lowlevel.current_trio_token()
            self._nursery = nursery
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                self._nursery = None  # refused from here on, while the streams are cancelled

    def submit(self, job: Job) -> None:
        """Start ``job``'s stream task in :meth:`run`'s nursery (synchronous; called from the
        asyncio handler, in the trio thread). Raises ``trio.ClosedResourceError`` when the
        bridge is not running."""
        nursery, context = self._nursery, self._context
        if nursery is None or context is None:
            raise trio.ClosedResourceError("the stream bridge is not running")
        try:
            context.run(nursery.start_soon, self.serve_job, job)
        except RuntimeError:  # the nursery is closing
            raise trio.ClosedResourceError("the stream bridge is stopping") from None

    async def serve_job(self, job: Job) -> None:
        """Admit and run one request; every exit closes ``job.send`` (the handler's end)."""
        self.active += 1
        try:
            async with job.send:
                await self._serve(job)
        finally:
            self.active -= 1
            job.wake()

    async def _serve(self, job: Job) -> None:
        sidecar = self.sidecar
        card = sidecar.card
        try:
            if card is None:
                raise Rejection(pb.ErrorCode.INTERNAL, "engine not discovered yet", True)
            mapped = to_generate_request(
                job.request, card, request_id=_request_id(job.context), trace_headers=_trace(job.context)
            )
            handle = sidecar.admit(mapped.request, mapped.metadata, kv_session_bytes=mapped.kv_session_bytes)
        except Rejection as rejection:
            outcome = Outcome.from_rejection(rejection)
            metrics.REQUESTS.labels(outcome.kind).inc()
            await self._finish(job, outcome, dynamo_cancelled=False)
            return
        job.handle = handle
        if job.abandoned:
            handle.cancel(OUTCOME_HANDLER_CLOSED)
        stopped = False
        send = job.send
        wake = job.wake

        async def emit(ev: pb.GenerateResponse) -> None:
            chunk = chunk_of(ev, handle.kv_session_bytes)
            if chunk is None:
                return
            try:
                try:
                    send.send_nowait(chunk)
                except trio.WouldBlock:  # the handler is behind: it reads before it waits
                    await send.send(chunk)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                raise ClientGone from None
            wake()

        async with trio.open_nursery() as nursery:
            if job.stopped is not None:

                async def watch_context() -> None:
                    nonlocal stopped
                    try:
                        await trio_asyncio.run_aio_future(job.stopped)
                    except Exception:  # the runtime dropped the signal: nothing to watch
                        return
                    stopped = True
                    handle.cancel(OUTCOME_DYNAMO_STOPPED)

                nursery.start_soon(watch_context)
            outcome = await sidecar.run_stream(handle, emit)
            nursery.cancel_scope.cancel()
        metrics.REQUESTS.labels(outcome.kind).inc()
        await self._finish(job, outcome, dynamo_cancelled=stopped or job.abandoned)

    async def _finish(self, job: Job, outcome: Outcome, *, dynamo_cancelled: bool) -> None:
        kind = error_kind(outcome, dynamo_cancelled=dynamo_cancelled)
        if kind is None:
            return
        if not dynamo_cancelled:
            log.info("dynamo request ended %s: %s", outcome.kind, outcome.message)
        with trio.move_on_after(1.0):
            try:
                await job.send.send(_Raise(kind, outcome.message or outcome.kind))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
            job.wake()

    # -- asyncio side (Dynamo's handler) -----------------------------------------------------

    async def handler(self, request: Any, context: Any = None) -> AsyncIterator[dict[str, Any]]:
        """Dynamo's endpoint handler: yields the stream's chunks (asyncio-flavoured)."""
        send, recv = trio.open_memory_channel[Any](self.buffer)
        stopped = context.async_killed_or_stopped() if context is not None else None
        job = Job(request, context, stopped, send)
        try:
            self.submit(job)
        except trio.ClosedResourceError:
            send.close()
            recv.close()
            if stopped is not None:
                stopped.cancel()
            raise _exception(_Raise("EngineShutdown", "this worker is not serving")) from None
        loop = self.loop or asyncio.get_running_loop()
        merge = ChunkMerger.merge
        pending: Any = None
        try:
            while True:
                if pending is not None:
                    item, pending = pending, None
                else:
                    while True:
                        try:
                            item = recv.receive_nowait()
                            break
                        except trio.WouldBlock:
                            job.waiter = loop.create_future()
                            await job.waiter
                        except trio.EndOfChannel:
                            return
                if isinstance(item, _Raise):
                    raise _exception(item)
                while True:
                    try:
                        nxt = recv.receive_nowait()
                    except (trio.WouldBlock, trio.EndOfChannel):
                        break
                    if isinstance(nxt, _Raise) or not merge(item, nxt):
                        pending = nxt
                        break
                yield item
        finally:
            self._abandon(job, recv)

    def _abandon(self, job: Job, recv: trio.MemoryReceiveChannel[Any]) -> None:
        """The handler is gone: cancel its stream and close its channel, in trio. Safe from any
        thread, loop or finalizer (Dynamo's runtime may close the generator from its own thread,
        garbage collection from anywhere): trio's state is only touched in trio's own thread."""

        def abandon() -> None:
            job.abandon()
            recv.close()

        token = self._token
        if token is None:  # never served (the job was refused before it started)
            return
        try:
            token.run_sync_soon(abandon)
        except trio.RunFinishedError:
            pass  # trio has ended: nothing is left to cancel


def _request_id(context: Any) -> str:
    if context is None:
        return ""
    try:
        rid = context.id()
    except Exception:
        return ""
    return rid if isinstance(rid, str) else ""


def _trace(context: Any) -> dict[str, str] | None:
    if context is None:
        return None
    try:
        headers = context.trace_headers()
    except Exception:
        return None
    return headers if isinstance(headers, dict) else None
