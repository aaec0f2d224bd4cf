"""The suite's fake engine: the :class:`~sidecar.openengine.client.EngineClient` surface in memory.

No network and no threads, so a test may run on trio's ``MockClock`` (``autojump_clock``)
and assert exact timings. Everything above the engine client — discovery, admission, the
stream supervisor, drain, the engine watch, the KV bridge's gRPC source — takes it where it
takes an ``EngineClient``.

- Discovery answers come from hand-built messages (``shape``, ``tests.core.shapes``);
  ``sources`` and ``loras`` answer ``GetKvEventSources`` / ``ListLoras``.
- ``fail`` maps a call (``"Health"``, ``"GetModelInfo:llama"``, ...) to the exception it raises.
- ``health_script`` (async) answers ``Health``; ``health_requests`` records what was asked.
- Generate streams run ``script`` and go through the real
  :class:`~sidecar.openengine.client.EngineStream` rules (an engine client error the script
  raises ends the stream with it, as a lost connection does); ``abort_delay`` holds every Abort.
- ``drain_events`` answer ``Drain``; ``drain_error`` is raised when it is opened instead.
- ``SubscribeKvEvents`` serves an engine's KV history: :meth:`publish` numbers and keeps a
  batch (``buffer_steps`` of them); a subscription resumes from ``start_sequence_number``
  when held, else from the oldest (``resume_error``: a terminal non-retryable error instead);
  ``include_snapshot`` sends the current cache as one batch (``snapshots=False``: refused
  ``INVALID_ARGUMENT``), numbered per ``snapshot_style``. Faults: ``deliver=False`` keeps a
  batch out of the live streams (an in-stream gap), :meth:`end_streams`, :meth:`restart`,
  ``kv_gate`` (subscriptions wait for it), ``kv_fail_next`` (raised at subscribe, in order).

``calls`` records every call in order.

The suite's two other engine fakes stand in at a lower layer, on real sockets, for the code
that speaks the wire: ``tests.openengine.fake_grpc_engine.FakeGrpcEngine`` (a scriptable
gRPC server: the engine client's framing, deadlines, cancellation, channel pool) and
``tests.kvbridge.fake_zmq_engine.FakeZmqEngine`` (an engine's ZMQ KV publisher in each wire
style). Whole engines as processes are ``sidecar.mock`` (``mock-engine``).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import trio

from sidecar.openengine import pb
from sidecar.openengine.client import EngineStream, MessageDecoder
from sidecar.openengine.engine_errors import (
    EngineClientError,
    EngineMessageTooLarge,
    EngineStatusError,
    EngineTerminalError,
    EngineUnavailable,
)
from sidecar.openengine.schema.decode import decode_generate_response
from sidecar.openengine.stream_rules import DrainRules, GenerateRules

#: A Generate script: sends the engine's events for one request (then returns: end of stream).
Script = Callable[[pb.GenerateRequest, trio.MemorySendChannel[pb.GenerateResponse]], Awaitable[None]]

MEDIUM = {m.name: m for m in pb.StorageMedium if m.name != "UNSPECIFIED"}


class ScriptedCall:
    """What a call on the wire is to an :class:`EngineStream` (``CallLike``): the messages a
    script sends, as bytes, then the end — or, after them, the engine client error the script
    raised (``failure``)."""

    def __init__(self, receive: trio.MemoryReceiveChannel[Any]) -> None:
        self._receive = receive
        self.failure: EngineClientError | None = None
        self.cancelled = False

    @property
    def ready(self) -> bool:
        stats = self._receive.statistics()
        return stats.current_buffer_used > 0 or stats.open_send_channels == 0

    async def receive(self) -> bytes | None:
        try:
            message = await self._receive.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            if self.failure is not None:
                raise self.failure from None
            return None
        return bytes(message)

    def cancel(self) -> None:
        self.cancelled = True


def status(name: str) -> EngineStatusError:
    """The error the engine client raises for a gRPC status ``name``."""
    return EngineStatusError(
        name, {"UNIMPLEMENTED": 12, "NOT_FOUND": 5, "INTERNAL": 13}.get(name, 2), "x", None
    )


def tokens_every(seconds: float, n: int) -> Script:
    """A script: ``n`` tokens ``seconds`` apart, then the finish (never ends when ``n`` < 0)."""

    async def script(request: pb.GenerateRequest, send: trio.MemorySendChannel[pb.GenerateResponse]) -> None:
        i = 0
        while n < 0 or i < n:
            await trio.sleep(seconds)
            await send.send(
                pb.GenerateResponse(
                    request_id=request.request_id, token=pb.TokenOutput(output_index=0, text=f"t{i}")
                )
            )
            i += 1
        await send.send(
            pb.GenerateResponse(
                request_id=request.request_id,
                finished=pb.GenerationFinished(output_index=0, reason=pb.FinishReason.LENGTH),
                usage=pb.Usage(prompt_tokens=1, completion_tokens=n, total_tokens=n + 1),
            )
        )

    return script


def pb_hash(h: int | bytes) -> pb.KvBlockHash:
    if isinstance(h, int):
        return pb.KvBlockHash(value=h.to_bytes(8, "big"), encoding="int64")
    return pb.KvBlockHash(value=h, encoding="bytes")


def to_pb(ev: dict[str, Any]) -> pb.KvEvent:
    """An output-form KV event dict (``tests.kvbridge.gen``) as the protobuf event an engine sends."""
    t = ev["type"]
    if t == "AllBlocksCleared":
        return pb.KvEvent(all_blocks_cleared=pb.AllBlocksCleared())
    medium = MEDIUM.get(ev.get("medium") or "", pb.StorageMedium.UNSPECIFIED)
    if t == "BlockRemoved":
        return pb.KvEvent(
            block_removed=pb.BlockRemoved(
                block_hashes=[pb_hash(h) for h in ev["block_hashes"]],
                medium=medium,
                group_idx=ev.get("group_idx") or 0,
            )
        )
    parent = ev["parent_block_hash"]
    return pb.KvEvent(
        request_id="req",
        block_stored=pb.BlockStored(
            block_hashes=[pb_hash(h) for h in ev["block_hashes"]],
            parent_block_hash=pb_hash(parent) if parent is not None else None,
            token_ids=ev["token_ids"],
            block_size=ev["block_size"],
            lora_id=ev["lora_id"] or 0,
            lora_name=ev["lora_name"] or "",
            medium=medium,
            extra_keys=[pb.OpaqueKeyTuple(values=k or []) for k in ev.get("extra_keys") or []],
            group_idx=ev.get("group_idx") or 0,
            kv_cache_spec_kind=ev.get("kv_cache_spec_kind") or "",
            kv_cache_spec_sliding_window=ev.get("kv_cache_spec_sliding_window") or 0,
        ),
    )


def apply(cache: dict[Any, dict[str, Any]], events: list[dict[str, Any]]) -> None:
    """The cache view a router keeps: block hash -> the BlockStored fields for it."""
    for ev in events:
        if ev["type"] == "AllBlocksCleared":
            cache.clear()
        elif ev["type"] == "BlockRemoved":
            for h in ev["block_hashes"]:
                cache.pop(h, None)
        else:
            for h in ev["block_hashes"]:
                cache[h] = {"medium": ev["medium"], "lora_id": ev["lora_id"]}


def _default_shape() -> tuple[pb.ServerInfo, dict[str, pb.ModelInfo]]:
    from tests.core.shapes import vllm_info

    return vllm_info()


class FakeEngine:
    """An in-memory engine behind the engine client's surface (see the module doc)."""

    def __init__(
        self,
        shape: tuple[pb.ServerInfo, dict[str, pb.ModelInfo]] | None = None,
        *,
        sources: list[pb.KvEventSource] | None = None,
        loras: list[pb.LoraAdapter] | None = None,
        fail: dict[str, Exception] | None = None,
        script: Script | None = None,
        abort_delay: float = 0.0,
        drain_events: list[pb.DrainResponse] | None = None,
        drain_error: Exception | None = None,
        rank: int = 0,
        buffer_steps: int = 1000,
        resume_error: bool = False,
        snapshots: bool = True,
        snapshot_style: str = "last",
    ) -> None:
        self.info, self.models = shape or _default_shape()
        self.sources = sources or []
        self.loras = loras or []
        self.fail = fail or {}
        self.calls: list[str] = []
        self.script = script or tokens_every(0.01, 3)
        self.abort_delay = abort_delay
        self.health_script: Callable[[], Awaitable[pb.HealthResponse]] | None = None
        self.health_requests: list[pb.HealthRequest] = []
        self.drain_events = drain_events or []
        self.drain_error = drain_error
        self.drain_requests: list[pb.DrainRequest] = []
        self.address = "fake:1"
        # the KV history (SubscribeKvEvents)
        self.rank = rank
        self.resume_error = resume_error
        self.snapshots = snapshots
        # "last": a snapshot is numbered like the last batch folded into it; "next" (the mock
        # engines): like the first live batch after it, and starts with AllBlocksCleared
        self.snapshot_style = snapshot_style
        self.seq = 0
        self.history: deque[pb.KvEventBatch] = deque(maxlen=buffer_steps)
        self.cache: dict[Any, dict[str, Any]] = {}
        self.kv_streams: list[trio.MemorySendChannel[Any]] = []
        self.kv_requests: list[pb.SubscribeKvEventsRequest] = []
        self.kv_fail_next: list[Exception] = []
        self.kv_gate: trio.Event | None = None
        self.kv_subscribed = trio.Event()

    def _call(self, name: str) -> None:
        self.calls.append(name)
        if name in self.fail:
            raise self.fail[name]

    # -- Control ---------------------------------------------------------------------------

    async def get_server_info(self) -> pb.ServerInfo:
        self._call("GetServerInfo")
        return self.info

    async def get_model_info(self, model: str = "") -> pb.ModelInfo:
        self._call(f"GetModelInfo:{model}")
        if model not in self.models:
            raise status("NOT_FOUND")
        return self.models[model]

    async def get_kv_event_sources(
        self, request: pb.GetKvEventSourcesRequest | None = None
    ) -> pb.GetKvEventSourcesResponse:
        self._call("GetKvEventSources")
        return pb.GetKvEventSourcesResponse(sources=self.sources)

    async def list_loras(self) -> pb.ListLorasResponse:
        self._call("ListLoras")
        return pb.ListLorasResponse(adapters=self.loras)

    async def health(self, request: pb.HealthRequest | None = None) -> pb.HealthResponse:
        self._call("Health")
        self.health_requests.append(request or pb.HealthRequest())
        if self.health_script is not None:
            return await self.health_script()
        return pb.HealthResponse(state=pb.HealthState.READY)

    def probe_liveness(self) -> None:
        self._call("ProbeLiveness")

    async def abort(self, request: pb.AbortRequest) -> pb.AbortResponse:
        self._call(f"Abort:{request.request_id}")
        await trio.sleep(self.abort_delay)
        return pb.AbortResponse(status=pb.AbortStatus.ABORTED)

    @asynccontextmanager
    async def drain(self, request: pb.DrainRequest) -> AsyncIterator[EngineStream[pb.DrainResponse]]:
        self._call("Drain")
        self.drain_requests.append(request)
        if self.drain_error is not None:
            raise self.drain_error
        send, receive = trio.open_memory_channel[pb.DrainResponse](math.inf)
        for event in self.drain_events:
            send.send_nowait(event)
        send.close()
        yield EngineStream(ScriptedCall(receive), None, MessageDecoder(pb.DrainResponse.parse), DrainRules())

    # -- Generate --------------------------------------------------------------------------

    @asynccontextmanager
    async def generate(
        self, request: pb.GenerateRequest, *, metadata: Any = None
    ) -> AsyncIterator[EngineStream[pb.GenerateResponse]]:
        self._call(f"Generate:{request.request_id}")
        send, receive = trio.open_memory_channel[pb.GenerateResponse](64)
        call = ScriptedCall(receive)
        rules = GenerateRules.for_request(request)
        stream = EngineStream(call, None, MessageDecoder(decode_generate_response), rules, request.request_id)
        async with trio.open_nursery() as nursery:

            async def run() -> None:
                async with send:
                    try:
                        await self.script(request, send)
                    except EngineClientError as exc:
                        call.failure = exc  # as a lost connection: raised after the events

            nursery.start_soon(run)
            try:
                yield stream
            finally:
                nursery.cancel_scope.cancel()

    # -- SubscribeKvEvents -----------------------------------------------------------------

    def _batch(self, seq: int, events: list[pb.KvEvent]) -> pb.KvEventBatch:
        return pb.KvEventBatch(
            sequence_number=seq,
            timestamp_unix_nanos=time.time_ns(),
            data_parallel_rank=self.rank,
            events=events,
        )

    def publish(
        self, events: list[dict[str, Any]], *, deliver: bool = True, raw: pb.KvEventBatch | None = None
    ) -> int:
        """Number and keep a batch of output-form ``events`` (or ``raw``); send it live unless
        ``deliver`` is False. Returns its sequence number."""
        seq = self.seq
        self.seq += 1
        batch = raw or self._batch(seq, [to_pb(e) for e in events])
        batch.sequence_number = seq
        apply(self.cache, events)
        self.history.append(batch)
        if deliver:
            for s in self.kv_streams:
                s.send_nowait(pb.SubscribeKvEventsResponse(batch=batch))
        return seq

    def end_streams(self, exc: Exception | None = None) -> None:
        """End every subscription (OK, or with ``exc``)."""
        for s in self.kv_streams:
            if exc is not None:
                s.send_nowait(exc)
            s.close()
        self.kv_streams.clear()

    def restart(self) -> None:
        """A new engine process: subscriptions lost, numbering from 0, empty history and cache."""
        self.end_streams(EngineUnavailable("engine restarted"))
        self.seq = 0
        self.history.clear()
        self.cache.clear()

    def _snapshot(self) -> pb.KvEventBatch:
        events = [
            to_pb(
                {
                    "type": "BlockStored",
                    "block_hashes": [h],
                    "parent_block_hash": None,
                    "token_ids": [],
                    "block_size": 0,
                    **v,
                    "lora_name": None,
                }
            )
            for h, v in self.cache.items()
        ]
        if self.snapshot_style == "next":
            return self._batch(self.seq, [to_pb({"type": "AllBlocksCleared"}), *events])
        return self._batch(max(self.seq - 1, 0), events)

    def _replay(self, request: pb.SubscribeKvEventsRequest, send: trio.MemorySendChannel[Any]) -> None:
        start = request.start_sequence_number
        if request.include_snapshot:
            if not self.snapshots:
                raise EngineStatusError(
                    "INVALID_ARGUMENT", 3, "snapshots unsupported", pb.ErrorCode.INVALID_ARGUMENT
                )
            send.send_nowait(pb.SubscribeKvEventsResponse(batch=self._snapshot()))
        elif self.history:
            oldest = self.history[0].sequence_number
            if start < oldest and self.resume_error and start > 0:
                err = pb.EngineError(
                    code=pb.ErrorCode.INVALID_ARGUMENT, message="start expired", retryable=False
                )
                send.send_nowait(EngineTerminalError(err, pb.SubscribeKvEventsResponse(error=err)))
            else:
                for b in self.history:
                    if b.sequence_number >= start:
                        send.send_nowait(pb.SubscribeKvEventsResponse(batch=b))

    @asynccontextmanager
    async def subscribe_kv_events(
        self, request: pb.SubscribeKvEventsRequest, *, max_message_bytes: int | None = None
    ) -> AsyncIterator[AsyncIterator[Any]]:
        self._call("SubscribeKvEvents")
        self.kv_requests.append(request)
        if self.kv_gate is not None:
            await self.kv_gate.wait()
        if self.kv_fail_next:
            raise self.kv_fail_next.pop(0)
        assert list(request.data_parallel_ranks) == [self.rank]
        send, receive = trio.open_memory_channel[Any](math.inf)
        self._replay(request, send)
        self.kv_streams.append(send)
        self.kv_subscribed.set()

        async def stream() -> AsyncIterator[Any]:
            async for item in receive:
                if isinstance(item, Exception):
                    raise item
                # as the EngineClient: a message over the bound fails the stream unread
                if max_message_bytes is not None and len(bytes(item)) > max_message_bytes:
                    raise EngineMessageTooLarge(len(bytes(item)), max_message_bytes)
                yield item

        try:
            yield stream()
        finally:
            if send in self.kv_streams:
                self.kv_streams.remove(send)
            send.close()
