"""Prefill/decode (disaggregated) generation across sidecars: the P/D coordinator.

    async with open_disagg(prefill=["ws://p1:8600", "ws://p2:8600"], decode=["ws://d1:8600"]) as pd:
        async with pd.generate({"prompt": "Hi", "stopping": {"maxTokens": 64}}) as flow:
            async for event in flow:            # the decode sidecar's events (wire.Event)
                ...
        flow.end                                # FlowEnd: outcome, error, who served, attempts
        flow.check()                            # raises DisaggError unless completed

One flow:

1. **Cards.** ``describe`` on the decode candidates, in order, until one is usable for the
   request (role ``decode``, servable, model, media on the prefill/decode path); then on the
   prefill candidates until one is usable and pairs with it (same handoff profile, transfer
   backend, bootstrap mode: ``disagg_pairing``). Nothing is sent to an engine before a pair
   is found, so a request no pair can serve leaves both engines untouched.
2. **Context-first** (vLLM, TensorRT-LLM: the connector does not use client bootstrap):
   prefill with ``max_tokens`` 1 until ``prefillReady``; then the decode ``generate`` carries
   its ``kvSessionBytes`` unchanged.
3. **Client bootstrap** (SGLang): a random room, unique among this coordinator's flows in
   flight, and the prefill card's bootstrap endpoint go into one ``KvSessionRef`` that both
   requests carry (as the same ``kvSessionBytes``); both start in one nursery. If either side
   ends without success the other is cancelled; the prefill must end with ``prefillReady``
   echoing the bootstrap.

Failover: a candidate that is unreachable, cannot ``describe``, is unusable, or rejects the
request with a retryable code (for the prefill also: fails retryably, since a prefill shows
the caller nothing) is skipped for the next in its list; every skip is listed in
``FlowEnd.attempts``. Once the decode has relayed an event there is no failover (an engine
error before any output is not relayed: it is that attempt's failure, in its ``end``). In client
bootstrap both sides run at once, so the side to replace is judged from how *both* ended,
never from which failure arrived first (:func:`_bootstrap_blame`): a prefill that failed
retryably, or a decode that could not get the KV from a prefill that did not complete, means
the next prefill (with the same decode); in context-first, a decode whose KV transfer failed
(the prefill's engine died after the handoff) runs the prefill again on the next prefill. A
hung peer is bounded too: a hung engine's sidecar
fails the stream (HTTP/2 PING liveness, docs/LIFECYCLE.md), a hung sidecar stops answering
WebSocket PINGs (``keepalive_interval`` / ``keepalive_timeout``) and counts as lost. A decode
retried after a context-first prefill reuses that prefill's KV session (it was not pulled);
a client-bootstrap retry runs both sides again with a new room.

Cancellation: leaving the ``generate`` block before the end (break, exception, cancellation)
cancels both sides; each sidecar stream gets ``cancel`` and its ``end`` is awaited, shielded
and bounded by ``cancel_timeout``, so both sidecars have closed their engine streams and sent
their Aborts. A context-first prefill that already completed holds its KV session until a
decode pulls it; when the flow ends without any decode having relayed an event (every decode
failed or was skipped, or the flow was cancelled before), the coordinator asks the prefill
sidecar to release it (north call ``releaseKvSession`` → the engine's ``Abort{kv_session}``),
shielded and bounded by ``cancel_timeout``; a failed release is logged (the engine's session
timeout then frees it).

Connections: one WebSocket per sidecar URL, opened on first use and shared by the flows of a
coordinator; a lost one is reopened by the next flow that needs it.
"""

from __future__ import annotations

import base64
import logging
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from functools import partial
from typing import Any

import trio

from sidecar.client.disagg_flow import (
    Attempt,
    DisaggError,
    DisaggFlow,
    FlowEnd,
    FlowOver,
    Role,
    Side,
    Worker,
    error_body,
)
from sidecar.client.disagg_pairing import (
    BOOTSTRAP,
    Pairing,
    PairingError,
    bootstrap_echoed,
    bootstrap_session,
    check_pair,
    check_worker,
    new_room,
    prefill_request,
)
from sidecar.client.sidecar_client import (
    SidecarCallError,
    SidecarClient,
    SidecarConnectionError,
    SidecarError,
    open_sidecar,
    sidecar_url,
)
from sidecar.north import wire
from sidecar.north.pbjson import PbJsonError, message_from_json
from sidecar.nursery import open_background_nursery
from sidecar.openengine import pb
from sidecar.openengine.engine_errors import wire_name

__all__ = [
    "Attempt",
    "DisaggClient",
    "DisaggError",
    "DisaggFlow",
    "FlowEnd",
    "open_disagg",
]

log = logging.getLogger(__name__)

TARGET_DP_RANK = "openengine-target-dp-rank"


async def _release_kv_session(prefill: Worker, kv: bytes) -> None:
    """Ask the prefill sidecar to free a KV session no decode will pull (best effort:
    shielded, bounded by the connection's ``cancel_timeout``; failures are logged)."""
    client = prefill.client
    with trio.CancelScope(shield=True), trio.move_on_after(client.cancel_timeout):
        try:
            await client.call("releaseKvSession", {"kvSessionBytes": base64.b64encode(kv).decode()})
            log.debug("released the KV session of %s", prefill.url)
        except SidecarError as err:
            log.info("could not release the KV session of %s: %s", prefill.url, err)


class _Candidates:
    """The sidecars of one side, in list order, each described once; skips go to ``flow.attempts``."""

    def __init__(self, coordinator: DisaggClient, flow: DisaggFlow, role: Role, urls: Sequence[str]) -> None:
        self._coord = coordinator
        self._flow = flow
        self._role: Role = role
        self._urls = list(urls)
        self._pos = 0

    async def next(
        self, fits: Callable[[Worker], Pairing | None] | None = None
    ) -> tuple[Worker, Pairing | None] | None:
        """The next usable worker (and what ``fits`` made of it), or ``None`` when none is left."""
        flow, role = self._flow, self._role
        while self._pos < len(self._urls):
            url = self._urls[self._pos]
            self._pos += 1
            worker = await self._coord._describe(flow, role, url)
            if worker is None:
                continue
            try:
                check_worker(worker.card, role, flow.request)
                return worker, fits(worker) if fits is not None else None
            except PairingError as err:
                flow.attempts.append(
                    Attempt(
                        role=role, url=url, result="unusable", code=wire_name(err.code), message=err.message
                    )
                )
        return None


class _Pool:
    """One shared connection per sidecar URL, each held open by a task in the coordinator's nursery."""

    def __init__(
        self, nursery: trio.Nursery, connect: Callable[[str], AbstractAsyncContextManager[SidecarClient]]
    ) -> None:
        self._nursery = nursery
        self._connect = connect
        self._held: dict[str, tuple[SidecarClient, trio.Event]] = {}
        self._locks: dict[str, trio.Lock] = {}

    async def get(self, url: str) -> SidecarClient:
        """An open connection to ``url``; raises ``SidecarConnectionError`` if it cannot be opened."""
        async with self._locks.setdefault(url, trio.Lock()):
            held = self._held.get(url)
            if held is not None and not held[0].closed:
                return held[0]
            if held is not None:
                held[1].set()  # let the dead connection's task end
            stop = trio.Event()
            client: SidecarClient = await self._nursery.start(self._hold, url, stop)
            self._held[url] = (client, stop)
            return client

    async def _hold(
        self,
        url: str,
        stop: trio.Event,
        *,
        task_status: trio.TaskStatus[SidecarClient] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        started = False
        try:
            async with self._connect(url) as client:
                started = True
                task_status.started(client)
                await stop.wait()
        except (SidecarConnectionError, OSError) as err:
            if not started:
                raise
            log.debug("connection to %s ended: %s", url, err)

    def close(self) -> None:
        """Close every connection (their tasks end; the nursery waits for them)."""
        for _, stop in self._held.values():
            stop.set()


class DisaggClient:
    """The coordinator of P/D flows over lists of prefill and decode sidecars; create with
    :func:`open_disagg`."""

    def __init__(
        self,
        pool: _Pool,
        prefill: Sequence[str],
        decode: Sequence[str],
        *,
        describe_timeout: float,
        settle_timeout: float,
        stream_buffer: int,
    ) -> None:
        self._pool = pool
        self.prefill_urls = list(prefill)
        self.decode_urls = list(decode)
        self._describe_timeout = describe_timeout
        self._settle_timeout = settle_timeout
        self._buffer = stream_buffer
        #: Bootstrap rooms of this coordinator's flows in flight (a new room avoids them).
        self.rooms_in_flight: set[int] = set()

    @asynccontextmanager
    async def generate(
        self,
        request: Mapping[str, Any] | pb.GenerateRequest,
        metadata: Mapping[str, str] | None = None,
    ) -> AsyncIterator[DisaggFlow]:
        """Run one P/D flow for ``request`` (a ``pb.GenerateRequest`` or its proto3 JSON form).

        A request the coordinator cannot use (invalid, or already carrying a KV session) ends
        the flow ``rejected`` (``ERROR_CODE_INVALID_ARGUMENT``) without contacting anyone.
        Leaving the block early cancels both sides (see the module doc).
        """
        try:
            req = (
                request
                if isinstance(request, pb.GenerateRequest)
                else message_from_json(pb.GenerateRequest, request, path="request")
            )
            invalid = None
            if req.kv is not None and req.kv.session is not None:
                invalid = "request.kv.session is set: the P/D coordinator creates the KV session"
        except PbJsonError as err:
            req, invalid = pb.GenerateRequest(), str(err)
        flow = DisaggFlow(req, metadata, self._buffer)
        if invalid is not None:
            flow.end = flow.ended("rejected", error_body(pb.ErrorCode.INVALID_ARGUMENT, invalid))
            flow.close_events()
            yield flow
            return
        try:
            async with open_background_nursery() as nursery:  # the driver never raises
                nursery.start_soon(self._drive, flow)
                try:
                    yield flow
                finally:
                    if flow.end is None:
                        nursery.cancel_scope.cancel(reason="P/D flow left early")
        finally:
            if flow.end is None:
                flow.end = flow.ended(
                    "cancelled", error_body(pb.ErrorCode.CANCELLED, "the P/D flow was cancelled")
                )

    async def _drive(self, flow: DisaggFlow) -> None:
        try:
            try:
                end = await self._run(flow)
            except FlowOver as over:
                end = over.end
            flow.end = end
        finally:
            flow.close_events()

    async def _describe(self, flow: DisaggFlow, role: Role, url: str) -> Worker | None:
        """Connect and ``describe``; ``None`` (with an attempt recorded) when that fails."""
        result, code, message = "unreachable", "ERROR_CODE_INTERNAL", ""
        with trio.move_on_after(self._describe_timeout):
            try:
                client = await self._pool.get(url)
                card = await client.call("describe")
                if isinstance(card, dict):
                    return Worker(url, client, card)
                result, message = "unusable", "describe returned no card"
            except SidecarConnectionError as err:
                message = str(err)
            except SidecarCallError as err:
                result, code, message = "unusable", err.code, err.message
                if err.retryable:
                    result = "unreachable"  # e.g. engine not discovered yet: another may serve
        if not message:
            message = f"no answer to describe within {self._describe_timeout:g}s"
        flow.attempts.append(
            Attempt(
                role=role,
                url=url,
                result=result,
                code=code,
                message=message,
                retryable=result == "unreachable",
            )
        )
        return None

    async def _run(self, flow: DisaggFlow) -> FlowEnd:
        prefills = _Candidates(self, flow, "prefill", self.prefill_urls)
        decodes = _Candidates(self, flow, "decode", self.decode_urls)
        found = await decodes.next()
        if found is None:
            await prefills.next()  # the prefill side's state too: the error names both when both are down
            raise flow.exhausted("decode")
        decode = found[0]
        picked = await prefills.next(_pairs_with_decode(decode))
        if picked is None:
            raise flow.exhausted("prefill")
        prefill, pairing = picked
        assert pairing is not None
        flow.mode = pairing.mode
        if pairing.mode == BOOTSTRAP:
            return await self._bootstrap(flow, prefill, pairing, decode, prefills, decodes)
        return await self._context_first(flow, prefill, decode, prefills, decodes)

    async def _run_side(
        self,
        flow: DisaggFlow,
        side: Side,
        request: pb.GenerateRequest,
        kv_session_bytes: bytes | None,
    ) -> None:
        """Run one side's stream (in ``side.scope``); decode events go to the caller — except
        an engine error that comes before any output: that is the attempt's failure (in its
        ``end`` and ``flow.attempts``), not output, so another decode may still be tried (a
        sidecar relays an engine's error as an event before its ``end``)."""

        async def deliver(event: wire.Event) -> None:
            if side.role == "decode":
                await flow.deliver(event)
            else:
                flow.prefill_events.append(event)

        try:
            with side.scope:
                try:
                    async with side.worker.client.generate(
                        request, flow.metadata, kv_session_bytes=kv_session_bytes
                    ) as stream:
                        side.stream = stream
                        async for event in stream:
                            if not side.events and event.response.kind == "error":
                                continue
                            side.events += 1
                            await deliver(event)
                except SidecarConnectionError as err:
                    side.lost = err
        finally:
            side.done.set()

    async def _context_first(
        self, flow: DisaggFlow, prefill: Worker, decode: Worker, prefills: _Candidates, decodes: _Candidates
    ) -> FlowEnd:
        """Prefill, then decode with its KV session. A decode that cannot get the KV (its
        transfer failed: the prefill's engine died after the handoff) goes back to the next
        prefill with the same decode; other decode failures go to the next decode."""
        while True:
            prefill, kv = await self._prefill_first(flow, prefill, decode, prefills)
            no_kv = await self._decode_with(flow, prefill, decode, kv, decodes)
            if no_kv is None:
                return flow.ended("completed", None)
            decode = no_kv
            picked = await prefills.next(_pairs_with_decode(decode))
            if picked is None:
                raise flow.exhausted("prefill")
            prefill = picked[0]

    async def _prefill_first(
        self, flow: DisaggFlow, prefill: Worker, decode: Worker, prefills: _Candidates
    ) -> tuple[Worker, bytes]:
        """Context-first prefill on ``prefill`` or the next that pairs with ``decode``: the
        worker that completed it and its KV session bytes."""
        pre_request = prefill_request(flow.request)
        while True:
            side = Side("prefill", prefill)
            await self._run_side(flow, side, pre_request, None)
            kv = side.stream.kv_session_bytes if side.stream is not None else None
            if side.ok and kv is None:
                side.problem = "completed without a prefillReady KV session"
            flow.attempts.append(side.attempt())
            if side.ok:
                assert kv is not None
                flow.prefill_url, flow.kv_session_bytes = prefill.url, kv
                return prefill, kv
            if not side.skippable:
                raise flow.side_over(side)
            picked = await prefills.next(_pairs_with_decode(decode))
            if picked is None:
                raise flow.exhausted("prefill")
            prefill = picked[0]

    async def _decode_with(
        self, flow: DisaggFlow, prefill: Worker, decode: Worker, kv: bytes, decodes: _Candidates
    ) -> Worker | None:
        """Decode ``kv`` on ``decode`` or the next one. ``None``: completed; a worker: that
        decode could not get the KV from ``prefill`` (run the prefill again elsewhere)."""
        relayed = 0  # events relayed by earlier decodes (one that relayed has pulled the session)
        last: Side | None = None  # the decode attempt in progress
        try:
            while True:
                flow.decode_url = decode.url
                side = last = Side("decode", decode)
                await self._run_side(flow, side, flow.request, kv)
                relayed += side.events
                flow.attempts.append(side.attempt())
                if side.ok:
                    return None
                if not side.events and _transfer_failed(side):
                    flow.decode_url = flow.prefill_url = flow.kv_session_bytes = None
                    await _release_kv_session(prefill, kv)  # if its engine still holds it
                    return decode
                if not side.skippable:
                    raise flow.side_over(side)
                flow.decode_url = None
                picked = await decodes.next(_pairs_with_prefill(prefill))
                if picked is None:
                    raise flow.exhausted("decode")
                decode = picked[0]
        except BaseException:
            if not relayed and not (last is not None and last.events):
                await _release_kv_session(prefill, kv)
            raise

    async def _bootstrap(
        self,
        flow: DisaggFlow,
        prefill: Worker,
        pairing: Pairing,
        decode: Worker,
        prefills: _Candidates,
        decodes: _Candidates,
    ) -> FlowEnd:
        while True:
            room = new_room(self.rooms_in_flight)
            self.rooms_in_flight.add(room)
            try:
                flow.room = room
                target = (flow.metadata or {}).get(TARGET_DP_RANK)
                session = bootstrap_session(pairing, room, target)
                pre, dec, first = await self._bootstrap_attempt(flow, prefill, decode, session)
            finally:
                self.rooms_in_flight.discard(room)
            flow.attempts.extend([pre.attempt(), dec.attempt()])
            flow.prefill_url, flow.decode_url = prefill.url, decode.url
            if dec.ok:
                flow.kv_session_bytes = session
                return flow.ended("completed", None)
            assert first is not None
            new: Pairing | None
            blame = _bootstrap_blame(pre, dec)
            if blame == "prefill":
                picked = await prefills.next(_pairs_with_decode(decode))
                if picked is None:
                    raise flow.exhausted("prefill")
                prefill, new = picked
            elif blame == "decode":
                picked = await decodes.next(_pairs_with_prefill(prefill))
                if picked is None:
                    raise flow.exhausted("decode")
                decode, new = picked
            else:
                raise flow.side_over(first)
            flow.prefill_url = flow.decode_url = None
            assert new is not None
            pairing = new

    async def _bootstrap_attempt(
        self, flow: DisaggFlow, prefill: Worker, decode: Worker, session: bytes
    ) -> tuple[Side, Side, Side | None]:
        """Both sides at once with the same bootstrap; the first to fail cancels the other.
        Returns both sides and the one that failed first (``None`` if neither failed)."""
        pre, dec = Side("prefill", prefill), Side("decode", decode)
        failed: list[Side] = []

        async def run_prefill() -> None:
            await self._run_side(flow, pre, flow.request, session)
            if pre.ok:
                pre.problem = bootstrap_echoed(session, pre.stream.kv_session_bytes if pre.stream else None)
            if not pre.ok:
                failed.append(pre)
                dec.scope.cancel(reason="the prefill side failed")

        async def run_decode() -> None:
            await self._run_side(flow, dec, flow.request, session)
            if not dec.ok:
                failed.append(dec)
                pre.scope.cancel(reason="the decode side failed")
                return
            with trio.move_on_after(self._settle_timeout):
                await pre.done.wait()
            if not pre.done.is_set():
                pre.scope.cancel(reason="the prefill did not end after the decode completed")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_prefill)
            nursery.start_soon(run_decode)
        if dec.ok and not pre.ok:
            log.warning("P/D flow: the decode completed but the prefill did not: %s", pre.attempt().message)
        return pre, dec, failed[0] if failed else None


#: A decode that fails with one of these could not get the KV from its prefill: the prefill
#: (its engine, its bootstrap endpoint) is the side to replace.
_TRANSFER_FAILURES = frozenset({"ERROR_CODE_KV_TRANSFER_FAILED", "ERROR_CODE_KV_SESSION_NOT_FOUND"})


def _transfer_failed(side: Side) -> bool:
    end = side.end
    return (
        side.lost is None
        and end is not None
        and end.error is not None
        and end.error.code in _TRANSFER_FAILURES
    )


def _bootstrap_blame(pre: Side, dec: Side) -> Role | None:
    """Which side of a failed client-bootstrap attempt to replace, from how *both* ended —
    never from which failure arrived first (both start at once: a dead prefill's refusal and
    the decode's failed transfer from it race). ``None``: no failover (the decode relayed
    events, or neither failure is one another worker may fix).

    - the prefill failed retryably (refused, failed, connection lost): the prefill;
    - the decode failed to get the KV (``KV_TRANSFER_FAILED``, ``KV_SESSION_NOT_FOUND``) while
      the prefill did not complete: the prefill — the decode could not reach it;
    - otherwise a decode that failed in a way another decode may fix: the decode.
    """
    if dec.events:
        return None
    if not pre.ok and pre.skippable:
        return "prefill"
    if _transfer_failed(dec) and not pre.ok:
        return "prefill"
    if dec.skippable:
        return "decode"
    return None


def _pairs_with_decode(decode: Worker) -> Callable[[Worker], Pairing]:
    return lambda prefill: check_pair(prefill.card, decode.card)


def _pairs_with_prefill(prefill: Worker) -> Callable[[Worker], Pairing]:
    return lambda decode: check_pair(prefill.card, decode.card)


@asynccontextmanager
async def open_disagg(
    prefill: Sequence[str],
    decode: Sequence[str],
    *,
    encoding: str = "json",
    connect_timeout: float = 5.0,
    cancel_timeout: float = 5.0,
    describe_timeout: float = 5.0,
    settle_timeout: float = 10.0,
    stream_buffer: int = 64,
    auth_token: str | None = None,
    ssl_context: Any = None,
    keepalive_interval: float = 10.0,
    keepalive_timeout: float = 10.0,
) -> AsyncIterator[DisaggClient]:
    """A P/D coordinator over ``prefill`` and ``decode`` sidecar URLs (each list tried in order).

    ``describe_timeout`` bounds connecting to and describing one sidecar (then it counts as
    unreachable); ``cancel_timeout`` bounds waiting for a cancelled stream's ``end``;
    ``settle_timeout`` bounds waiting for a bootstrap prefill's end after its decode completed;
    ``keepalive_interval`` / ``keepalive_timeout``: each sidecar connection's PING liveness
    (``open_sidecar``).
    Raises ``ValueError`` for an empty list or a malformed URL. Leaving the block closes the
    connections (leave the flows' blocks first).
    """
    if not prefill or not decode:
        raise ValueError("give at least one prefill and one decode sidecar URL")
    prefill_urls = [sidecar_url(u) for u in prefill]
    decode_urls = [sidecar_url(u) for u in decode]
    connect = partial(
        open_sidecar,
        encoding=encoding,
        connect_timeout=connect_timeout,
        cancel_timeout=cancel_timeout,
        stream_buffer=stream_buffer,
        auth_token=auth_token,
        ssl_context=ssl_context,
        keepalive_interval=keepalive_interval,
        keepalive_timeout=keepalive_timeout,
    )
    async with open_background_nursery() as nursery:  # the pool's tasks never raise
        pool = _Pool(nursery, connect)
        try:
            yield DisaggClient(
                pool,
                prefill_urls,
                decode_urls,
                describe_timeout=describe_timeout,
                settle_timeout=settle_timeout,
                stream_buffer=stream_buffer,
            )
        finally:
            pool.close()
