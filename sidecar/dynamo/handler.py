"""One Dynamo request ↔ one admitted stream: the bridge between Dynamo's handler and trio.

Dynamo's runtime calls the endpoint handler — an asyncio async generator — on the
trio-asyncio loop, and pulls one chunk per ``__anext__``. The stream itself is a trio task
owned by the plane's stream nursery and runs the SAME admission and lifecycle as the
WebSocket plane (``Sidecar.admit`` / ``Sidecar.run_stream``):

    Dynamo ──handler(request, context)──▶ job ──dispatcher──▶ stream task (trio)
           ◀──yield chunk── bounded trio channel ◀──emit(event)──┘

- The handler only hands the job over (a synchronous ``send_nowait``) and reads the
  channel: ``receive_nowait`` while chunks are queued (several queued token chunks of one
  output are merged into one), else it awaits the channel through the captured loop's
  ``trio_as_future`` (trio-asyncio's current-loop context is not set inside Dynamo's
  handler, so the loop object is used directly).
- Cancellation: Dynamo does not cancel the handler when the HTTP client goes away; it
  stops or kills the request ``context``. The stream task watches
  ``context.async_killed_or_stopped()`` in its own nursery and cancels the stream — the
  lifecycle then closes the upstream and sends ``Abort``. If Dynamo closes the generator
  instead, its ``finally`` cancels the stream the same way.
- A stream that did not complete ends with a ``dynamo.llm.exceptions`` error
  (``mapping.error_kind``): 400-class for client errors, retryable kinds for draining or
  engine loss, nothing when Dynamo itself stopped the request.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import trio
import trio_asyncio

from sidecar.core.errors import Rejection
from sidecar.core.lifecycle import CANCELLED, ClientGone, Outcome
from sidecar.dynamo import metrics
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

    __slots__ = ("abandoned", "context", "handle", "request", "send", "stopped")

    def __init__(self, request: Any, context: Any, stopped: Any, send: trio.MemorySendChannel[Any]) -> None:
        self.request = request
        self.context = context
        #: asyncio future resolved when Dynamo stops or kills the request (``None`` in tests).
        self.stopped = stopped
        self.send = send
        self.handle: Any = None
        self.abandoned = False

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
    return cls(item.message)  # type: ignore[no-any-return]


class StreamBridge:
    """Serves Dynamo requests through a :class:`~sidecar.core.sidecar.Sidecar`.

    ``handler`` is the Dynamo endpoint handler (asyncio-flavoured); :meth:`run` is the trio
    service that owns the streams (start it in the plane's nursery before serving).
    """

    def __init__(self, sidecar: Any, loop: Any = None, *, buffer: int = CHUNK_BUFFER) -> None:
        self.sidecar = sidecar
        self.loop = loop
        self.buffer = buffer
        self._jobs_send, self._jobs_recv = trio.open_memory_channel[Job](10_000)
        self.active = 0

    # -- trio side ---------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Start a stream task per job until cancelled (then every stream is cancelled)."""
        async with trio.open_nursery() as nursery:
            task_status.started()
            async with self._jobs_recv:
                async for job in self._jobs_recv:
                    nursery.start_soon(self.serve_job, job)

    def submit(self, job: Job) -> None:
        """Hand a job to :meth:`run` (synchronous; callable from the asyncio handler)."""
        self._jobs_send.send_nowait(job)

    async def serve_job(self, job: Job) -> None:
        """Admit and run one request; every exit closes ``job.send`` (the handler's end)."""
        self.active += 1
        try:
            async with job.send:
                await self._serve(job)
        finally:
            self.active -= 1

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

        async def emit(ev: pb.GenerateResponse) -> None:
            chunk = chunk_of(ev, handle.kv_session_bytes)
            if chunk is None:
                return
            try:
                try:
                    send.send_nowait(chunk)
                except trio.WouldBlock:
                    await send.send(chunk)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                raise ClientGone from None

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

    # -- asyncio side (Dynamo's handler) -----------------------------------------------------

    async def handler(self, request: Any, context: Any = None) -> AsyncIterator[dict[str, Any]]:
        """Dynamo's endpoint handler: yields the stream's chunks (asyncio-flavoured)."""
        send, recv = trio.open_memory_channel[Any](self.buffer)
        stopped = context.async_killed_or_stopped() if context is not None else None
        job = Job(request, context, stopped, send)
        try:
            self.submit(job)
        except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
            send.close()
            recv.close()
            if stopped is not None:
                stopped.cancel()
            raise _exception(_Raise("EngineShutdown", "this worker is not serving")) from None
        loop = self.loop
        merge = ChunkMerger.merge
        pending: Any = None
        try:
            while True:
                if pending is not None:
                    item, pending = pending, None
                else:
                    try:
                        item = recv.receive_nowait()
                    except trio.WouldBlock:
                        try:
                            item = await loop.trio_as_future(recv.receive)
                        except trio.EndOfChannel:
                            return
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
            job.abandon()
            recv.close()


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
