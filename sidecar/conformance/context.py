"""What every check works with: the engine clients, cached discovery, request and stream helpers.

Resources: the :class:`~sidecar.openengine.client.EngineClient` objects are owned by the
runner (opened before the first check, closed after the last); a :class:`LiveStream`
holds one Generate call until its ``async with`` block ends (leaving early resets the
HTTP/2 stream). Discovery answers are cached for the whole run (they are static per
deployment); a failing discovery call is re-raised to every check that needs it.
"""

from __future__ import annotations

import itertools
import secrets
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import trio

from sidecar.conformance.model import Fail, Skip
from sidecar.conformance.streams import StreamRecord, kind, terminal_position
from sidecar.openengine import pb
from sidecar.openengine.client import EngineClient, MetadataLike
from sidecar.openengine.engine_errors import (
    EngineClientError,
    EngineProtocolError,
    EngineStatusError,
    EngineUnavailable,
)

__all__ = ["Context", "LiveStream", "SuiteOptions"]

PROMPT = "The quick brown fox jumps over the lazy dog while the five boxing wizards jump quickly."
#: Token ids used for token-id prompts: common ids in any real vocabulary, clear of the low specials.
TOKEN_BASE = 1000
TOKEN_SPAN = 1000
#: How long a call may stay open after its terminal event (the engine closes it at once; the
#: sidecar fails a stream silent for ``--inactivity-timeout``, 30 s by default).
CLOSE_WITHIN = 3.0


@dataclass(frozen=True)
class SuiteOptions:
    """What the command line asked for (see ``openengine-sidecar conformance --help``)."""

    engine: str | None = None
    model: str | None = None
    prefill: str | None = None
    decode: str | None = None
    only: tuple[str, ...] = ()
    skip: tuple[str, ...] = ()
    destructive: bool = False
    lora_path: str | None = None
    check_timeout: float | None = None  # None = each check's own bound
    connect_timeout: float = 5.0


class LiveStream:
    """One open Generate call read event by event into its :class:`StreamRecord`."""

    def __init__(
        self, stream: Any, record: StreamRecord, on_transport: Callable[[], None] | None = None
    ) -> None:
        self._stream = stream
        self.record = record
        self.done = False
        self._on_transport = on_transport

    async def next(self) -> pb.GenerateResponse | None:
        """The next event, or ``None`` once the call ended (how is in ``record.end``)."""
        if self.done:
            return None
        rec = self.record
        try:
            event: pb.GenerateResponse = await self._stream.__anext__()
        except StopAsyncIteration:
            self.done, rec.end = True, "ok"
            return None
        except EngineStatusError as err:
            self.done, rec.end, rec.status, rec.status_message = True, "status", err.status, err.message
            return None
        except EngineProtocolError as err:  # a message the client cannot take: not a lost engine
            self.done, rec.end, rec.error = True, "protocol", str(err)
            return None
        except (EngineUnavailable, EngineClientError) as err:
            self.done, rec.end, rec.error = True, "transport", str(err)
            if self._on_transport is not None:
                self._on_transport()
            return None
        rec.events.append(event)
        return event

    async def until(self, kinds: Sequence[str], timeout: float) -> pb.GenerateResponse | None:
        """Read until an event of one of ``kinds`` arrives (``None``: the call ended or time ran out)."""
        with trio.move_on_after(timeout):
            while (event := await self.next()) is not None:
                if kind(event) in kinds:
                    return event
        return None

    async def rest(self, timeout: float, *, close_within: float = CLOSE_WITHIN) -> bool:
        """Read to the end of the call; False (and ``end = "timeout"``, ``gave_up`` saying why) if
        it did not end within ``timeout``, or within ``close_within`` of its terminal event."""
        rec = self.record
        closing = False
        with trio.move_on_after(timeout) as scope:
            ends = True  # whether the last event read may have been the terminal one
            while True:
                if not closing and ends and terminal_position(rec) is not None:
                    scope.deadline = min(scope.deadline, trio.current_time() + close_within)
                    closing = True
                if (event := await self.next()) is None:
                    return True
                ends = kind(event) in ("finished", "prefill_ready", "error")
        self.done, rec.end = True, "timeout"
        rec.gave_up = (
            f"not closed within {close_within:g} s of its terminal event"
            if closing
            else f"did not end within {timeout:g} s"
        )
        return False


class Context:
    """Shared state of one conformance run (see the module doc)."""

    def __init__(
        self,
        options: SuiteOptions,
        *,
        engine: EngineClient | None = None,
        prefill: EngineClient | None = None,
        decode: EngineClient | None = None,
    ) -> None:
        self.options = options
        self.clients = {"engine": engine, "prefill": prefill, "decode": decode}
        self.run_id = secrets.token_hex(4)
        self._ids = itertools.count(1)
        self._info: dict[str, pb.ServerInfo | BaseException] = {}
        self._model_info: dict[str, pb.ModelInfo | BaseException] = {}
        self.cache: dict[str, Any] = {}
        #: Generate calls that ended with a lost connection so far (the runner then checks
        #: whether the engine is still there).
        self.transport_errors = 0

    def _saw_transport_error(self) -> None:
        self.transport_errors += 1

    # -- clients and discovery ----------------------------------------------------------

    def client(self, which: str = "engine") -> EngineClient:
        c = self.clients.get(which)
        if c is None:
            raise Skip(f"no --{which} address given")
        return c

    async def server_info(self, which: str = "engine") -> pb.ServerInfo:
        cached = self._info.get(which)
        if cached is None:
            try:
                cached = await self.client(which).get_server_info()
            except EngineClientError as err:
                cached = err
            self._info[which] = cached
        if isinstance(cached, BaseException):
            raise Fail(f"GetServerInfo failed: {cached}")
        return cached

    async def role(self, which: str = "engine") -> pb.EngineRole:
        return (await self.server_info(which)).engine_role

    async def connector(self, which: str = "engine") -> pb.KvConnectorInfo | None:
        return (await self.server_info(which)).kv_connector

    async def uses_bootstrap(self, which: str = "engine") -> bool:
        kv = await self.connector(which)
        return bool(kv is not None and kv.enabled and kv.supports_client_bootstrap)

    async def standalone(self, which: str = "engine") -> str | None:
        """How a plain request completes on this engine alone: ``"aggregated"`` (tokens and
        finishes), ``"prefill"`` (a context-first prefill ending in PrefillReady), or
        ``None`` (a decode engine, or a prefill that needs a bootstrap partner)."""
        role = await self.role(which)
        if role == pb.EngineRole.AGGREGATED:
            return "aggregated"
        if role == pb.EngineRole.PREFILL and not await self.uses_bootstrap(which):
            return "prefill"
        return None

    async def model(self, which: str = "engine") -> str:
        if self.options.model:
            return self.options.model
        models = (await self.server_info(which)).supported_models
        if not models:
            raise Fail("ServerInfo.supported_models is empty: no model to test with")
        return models[0]

    async def model_info(self, which: str = "engine") -> pb.ModelInfo:
        cached = self._model_info.get(which)
        if cached is None:
            try:
                cached = await self.client(which).get_model_info(await self.model(which))
            except EngineClientError as err:
                cached = err
            self._model_info[which] = cached
        if isinstance(cached, BaseException):
            raise Fail(f"GetModelInfo({await self.model(which)!r}) failed: {cached}")
        return cached

    async def dp_ranks(self, which: str = "engine") -> list[int]:
        par = (await self.server_info(which)).parallelism
        size = par.data_parallel_size if par is not None else None
        start = par.data_parallel_start_rank if par is not None else None
        return list(range(start or 0, (start or 0) + (size or 1)))

    async def long_max_tokens(self, which: str = "engine") -> int:
        """A ``max_tokens`` that keeps a request busy for a while but fits the model's limits."""
        mi = await self.model_info(which)
        limit = 4096
        if mi.max_output_tokens:
            limit = min(limit, mi.max_output_tokens)
        if mi.max_context_length:
            limit = min(limit, max(1, mi.max_context_length - 256))
        return limit

    # -- requests -------------------------------------------------------------------------

    def new_id(self, label: str) -> str:
        return f"conformance-{self.run_id}-{label}-{next(self._ids)}"

    def token_ids(self, count: int) -> list[int]:
        """Fresh random token ids (so prefix caches never share blocks across requests)."""
        return [TOKEN_BASE + secrets.randbelow(TOKEN_SPAN) for _ in range(count)]

    async def request(
        self,
        label: str,
        *,
        which: str = "engine",
        max_tokens: int | None = 8,
        prompt: str | None = None,
        token_ids: Sequence[int] | None = None,
        num_sequences: int | None = None,
        ignore_eos: bool | None = None,
        temperature: float | None = None,
        seed: int | None = None,
        stop_token_ids: Sequence[int] = (),
        prompt_logprobs: bool = False,
        session: pb.KvSessionRef | None = None,
        lora_name: str = "",
    ) -> pb.GenerateRequest:
        req = pb.GenerateRequest(request_id=self.new_id(label), model=await self.model(which))
        if token_ids is not None:
            req.token_ids = pb.TokenIds(ids=list(token_ids))
        else:
            req.prompt = prompt if prompt is not None else PROMPT
        if num_sequences is not None or temperature is not None or seed is not None:
            req.sampling = pb.SamplingParams(num_sequences=num_sequences, temperature=temperature, seed=seed)
        stopping = pb.StoppingOptions(max_tokens=max_tokens, ignore_eos=ignore_eos)
        stopping.conditions = [pb.StopCondition(stop_token_id=t) for t in stop_token_ids]
        req.stopping = stopping
        if prompt_logprobs:
            req.response = pb.ResponseOptions(return_prompt_logprobs=True)
        if session is not None:
            req.kv = pb.KvOptions(session=session)
        req.lora_name = lora_name
        return req

    @asynccontextmanager
    async def open(
        self,
        request: pb.GenerateRequest,
        *,
        which: str = "engine",
        label: str = "",
        metadata: MetadataLike | None = None,
    ) -> AsyncIterator[LiveStream]:
        """Open a raw Generate call; leaving the block early records ``end = "left"``."""
        record = StreamRecord(label or request.request_id, request)
        async with self.client(which).generate(request, metadata=metadata, checked=False) as stream:
            live = LiveStream(stream, record, self._saw_transport_error)
            try:
                yield live
            finally:
                if not live.done:
                    record.end = "left"

    async def record(
        self,
        request: pb.GenerateRequest,
        *,
        which: str = "engine",
        label: str = "",
        metadata: MetadataLike | None = None,
        timeout: float = 15.0,
    ) -> StreamRecord:
        """Run one Generate call to its end (at most ``timeout`` s) and return its record."""
        async with self.open(request, which=which, label=label, metadata=metadata) as live:
            await live.rest(timeout)
        return live.record

    # -- load -----------------------------------------------------------------------------

    async def busy(self, which: str = "engine") -> int | None:
        """Running + queued requests as GetLoad reports them (None when not reported)."""
        try:
            load = await self.client(which).get_load(include_per_rank=False)
        except EngineStatusError:
            return None
        if load.running_requests is None:
            return None
        return load.running_requests + (load.queued_requests or 0)

    async def wait_busy(self, baseline: int, timeout: float, which: str = "engine") -> bool:
        """Poll GetLoad until more than ``baseline`` requests are running or queued.

        Judged by answers, not by the clock alone: a poll under way at the deadline may finish
        (bounded by another ``timeout``), and one more is made if none answered, so a host that
        stalled every process past the deadline is not taken for an engine that never counted
        the request."""
        deadline = trio.current_time() + timeout
        answered = False
        with trio.move_on_after(2 * timeout):
            while True:
                now = await self.busy(which)
                if now is not None and now > baseline:
                    return True
                answered = answered or now is not None
                if trio.current_time() >= deadline and answered:
                    return False
                await trio.sleep(0.02)
        return False

    async def abort(self, which: str = "engine", **target: Any) -> str:
        """Call Abort; returns the AbortStatus name (``ABORTED``, ``ALREADY_FINISHED``, ...) or,
        for a non-OK answer, ``status <NAME>``."""
        try:
            reply = await self.client(which).abort(pb.AbortRequest(**target))
        except EngineStatusError as err:
            return f"status {err.status}"
        return pb.AbortStatus(reply.status).name or f"UNKNOWN({int(reply.status)})"


def describe_status(rec: StreamRecord) -> str:
    if rec.end == "status":
        return f"status {rec.status}" + (f" ({rec.status_message})" if rec.status_message else "")
    return rec.summary()
