"""Prefill → decode KV transfer of the simulated engines: a small TCP protocol and the handoffs.

Protocol (the mock's own): one request per TCP connection; every message is a
frame ``length (4 bytes big-endian) + msgpack map`` (at most 16 MiB).

* ``{"op": "pull", "session_id": s}`` → ``{"ok": true, "session": KvSessionPayload}``
  and the prefill releases the session (a second pull is not found), or
  ``{"ok": false, "code": "KV_SESSION_NOT_FOUND" | "KV_TRANSFER_FAILED", "message": m}``.
* ``{"op": "register", "room": r}`` (SGLang bootstrap; the decode side) → the reply
  waits until the prefill of room ``r`` hands its blocks over (then ``ok`` as for
  ``pull``), or fails with ``KV_TRANSFER_FAILED`` after the bootstrap timeout.

Integration (for the engine)::

    server = KvTransferServer(host=cfg.transfer_host, port=cfg.transfer_port,
                              session_ttl=cfg.kv_session_timeout_s,
                              bootstrap_timeout=cfg.bootstrap_timeout_s)
    async with server:                 # listening; on exit: closed, held sessions released
        server.endpoint                # -> KvConnectorInfo.local_endpoints (routable host)

    # prefill (vLLM / TRT-LLM, context-first), after the prefill allocation ``alloc``:
    payload = KvSessionPayload.from_allocation(session_id, alloc, extra={...})
    server.hold(payload, release=lambda: cache.release(alloc))   # until pulled / TTL / drop()
    ref = vllm_session_ref(...) | trtllm_session_ref(...)         # -> PrefillReady.kv_session
    # prefill (SGLang): room = prefill_bootstrap_room(request.kv.session, server.endpoint)
    await server.send_bootstrap(room, payload, release=...)       # KvTransferFailed if no decode comes
    ref = sglang_session_ref(...)
    # Abort{kv_session}: server.drop(session_id) -> False = unknown (NOT_FOUND);
    # SGLang room: server.abort_room(room); Abort{all} / drain: server.drop_all()
    # GetLoad / Drain open_kv_sessions: server.open_sessions; held ids: server.session_ids()

    # decode: locator = resolve_session(request.kv.session)  # InvalidKvSession -> INVALID_ARGUMENT status
    payload = await fetch_session(locator)                   # KvTransferError -> terminal EngineError
    verify_payload(payload, compute_block_hashes(prompt_ids, block_size, ...))

Payload, errors and handoffs live in ``sidecar.mock.transfer_session`` (I/O-free)
and are re-exported here.

Errors: :class:`KvSessionNotFound` (missing, consumed or expired session →
``ERROR_CODE_KV_SESSION_NOT_FOUND``), :class:`KvTransferFailed` (connection
failure, timeout, bootstrap without partner, block count / hash / opaque-state
mismatch → ``ERROR_CODE_KV_TRANSFER_FAILED``); both are :class:`KvTransferError`
with ``.to_engine_error()``. :class:`InvalidKvSession` (a ``ValueError``) is a
malformed handoff, to be refused before acceptance.

Handoff attributes (``KvSessionRef.attributes_struct``; Struct numbers are
doubles, so integers that may exceed 2**53 travel as decimal strings):

* ``vllm.kv_transfer_params.v1``: ``do_remote_prefill`` true, ``do_remote_decode``
  false, ``remote_engine_id``, ``remote_request_id`` (= session id),
  ``remote_block_ids`` (one per block, partial tail included), ``remote_host``,
  ``remote_port``, ``tp_size``. Decode pulls from remote_host:remote_port.
* ``tensorrt_llm.disaggregated_params.v1``: ``request_type`` ``context_only``
  (decode accepts it or ``generation_only``), ``ctx_request_id`` and
  ``disagg_request_id`` (decimal strings, > 2**53; the session id),
  ``encoded_opaque_state`` (base64 of msgpack ``{v, sid, n, digest}``: the decode
  checks it against what it pulls), ``first_gen_tokens``, ``draft_tokens``,
  ``ctx_dp_rank``, ``ctx_info_endpoint`` (``tcp://host:port``, pulled from).
* ``sglang.bootstrap.v1``: ``bootstrap_host``, ``bootstrap_port``,
  ``bootstrap_room`` (decimal string) echoing ``KvSessionRef.bootstrap``, which
  the client set identically on the prefill and the decode request. On a schema
  without client bootstrap (``sidecar.mock.schemas``) the prefill picks the room,
  holds the blocks like vLLM and returns the same attributes in ``PrefillReady``
  (``sglang_context_session_ref``); the decode pulls them by session id.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from sidecar.mock.kvevents import routable_host
from sidecar.mock.transfer_session import (
    SGLANG_PROFILE,
    TRTLLM_PROFILE,
    VLLM_PROFILE,
    InvalidKvSession,
    KvSessionNotFound,
    KvSessionPayload,
    KvTransferError,
    KvTransferFailed,
    SessionLocator,
    error_from_code,
    new_ctx_request_id,
    prefill_bootstrap_room,
    resolve_session,
    sglang_context_session_ref,
    sglang_session_ref,
    trtllm_session_ref,
    verify_payload,
    vllm_session_ref,
)
from sidecar.openengine import pb

__all__ = [
    "SGLANG_PROFILE",
    "TRTLLM_PROFILE",
    "VLLM_PROFILE",
    "InvalidKvSession",
    "KvSessionNotFound",
    "KvSessionPayload",
    "KvTransferError",
    "KvTransferFailed",
    "KvTransferServer",
    "SessionLocator",
    "bootstrap_receive",
    "fetch_session",
    "new_ctx_request_id",
    "prefill_bootstrap_room",
    "pull_session",
    "resolve_session",
    "sglang_context_session_ref",
    "sglang_session_ref",
    "trtllm_session_ref",
    "verify_payload",
    "vllm_session_ref",
]

logger = logging.getLogger(__name__)

_MAX_FRAME = 16 * 1024 * 1024
_REQUEST_TIMEOUT = 10.0


# --------------------------------------------------------------------------- framing

_enc = msgspec.msgpack.Encoder()


async def _write(writer: asyncio.StreamWriter, msg: dict[str, Any]) -> None:
    data = _enc.encode(msg)
    writer.write(struct.pack(">I", len(data)) + data)
    await writer.drain()


async def _read(reader: asyncio.StreamReader) -> dict[str, Any]:
    (n,) = struct.unpack(">I", await reader.readexactly(4))
    if n > _MAX_FRAME:
        raise ValueError(f"frame of {n} bytes exceeds {_MAX_FRAME}")
    msg = msgspec.msgpack.decode(await reader.readexactly(n))
    if not isinstance(msg, dict):
        raise ValueError("frame is not a map")
    return msg


def _ok(payload: KvSessionPayload) -> dict[str, Any]:
    return {"ok": True, "session": msgspec.to_builtins(payload)}


def _fail(err: KvTransferError) -> dict[str, Any]:
    return {"ok": False, "code": pb.ErrorCode(err.code).name, "message": str(err)}


# --------------------------------------------------------------------------- server


@dataclass
class _Held:
    payload: KvSessionPayload
    release: Callable[[], None] | None
    timer: asyncio.TimerHandle | None


class _Room:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.registered: asyncio.Future[None] = loop.create_future()
        self.payload: asyncio.Future[KvSessionPayload] = loop.create_future()
        self.delivered: asyncio.Future[None] = loop.create_future()
        self.prefill: Literal["none", "waiting", "done"] = "none"
        self.decode: Literal["none", "waiting", "done"] = "none"


def _call(release: Callable[[], None] | None) -> None:
    if release is None:
        return
    try:
        release()
    except Exception:
        logger.exception("releasing KV session blocks failed")


class KvTransferServer:
    """The prefill engine's transfer / bootstrap server (asyncio; use ``async with``).

    Holds pulled-mode sessions until pulled, dropped or ``session_ttl`` seconds
    pass (then ``release`` runs and a pull is answered KV_SESSION_NOT_FOUND), and
    SGLang rooms until both sides met or ``bootstrap_timeout`` passed. On exit the
    listener closes, connection handlers are cancelled, held sessions released.
    """

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        session_ttl: float = 60.0,
        bootstrap_timeout: float = 5.0,
        protocol: str = "tcp",
    ) -> None:
        self.bind_host = host
        self.host = routable_host(host, advertise_host)
        self.port = port
        self.protocol = protocol
        self.session_ttl = session_ttl
        self.bootstrap_timeout = bootstrap_timeout
        self._server: asyncio.Server | None = None
        self._sessions: dict[str, _Held] = {}
        self._rooms: dict[int, _Room] = {}
        self._handlers: set[asyncio.Task[Any]] = set()

    @property
    def endpoint(self) -> pb.KvEndpoint:
        return pb.KvEndpoint(host=self.host, port=self.port, protocol=self.protocol)

    @property
    def open_sessions(self) -> int:
        """Sessions held for a pull plus bootstrap rooms in flight."""
        return len(self._sessions) + len(self._rooms)

    def has_session(self, session_id: str) -> bool:
        return session_id in self._sessions

    def session_ids(self) -> list[str]:
        """Ids of the sessions held for a pull."""
        return list(self._sessions)

    def drop_all(self) -> int:
        """Drop (and release) every held session and fail every bootstrap room; returns how many."""
        count = sum(self.drop(sid) for sid in list(self._sessions))
        return count + sum(self.abort_room(room) for room in list(self._rooms))

    async def __aenter__(self) -> KvTransferServer:
        self._server = await asyncio.start_server(self._handle, self.bind_host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
        # asyncio's stream server starts a task per connection (no task group for them in
        # 3.11): cancelled here and awaited; each logs its own failure
        handlers = list(self._handlers)
        for task in handlers:
            task.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None
        for sid in list(self._sessions):
            self.drop(sid)
        for room in self._rooms.values():
            for fut in (room.registered, room.payload, room.delivered):
                if not fut.done():
                    fut.set_exception(KvTransferFailed("KV transfer server closed"))
                    fut.exception()  # mark retrieved
        self._rooms.clear()

    # ---- pull mode
    def hold(
        self,
        payload: KvSessionPayload,
        release: Callable[[], None] | None = None,
        *,
        ttl: float | None = None,
    ) -> None:
        """Keep ``payload`` for a decode pull; ``release`` runs once when pulled, dropped or expired."""
        if payload.session_id in self._sessions:
            raise ValueError(f"KV session {payload.session_id!r} already held")
        # an expiry of held data, not an activity: a timer handle dropped with the session
        timer = asyncio.get_running_loop().call_later(
            self.session_ttl if ttl is None else ttl, self._expire, payload.session_id
        )
        self._sessions[payload.session_id] = _Held(payload, release, timer)

    def drop(self, session_id: str) -> bool:
        """Forget and release a held session (Abort / drain). False if it is not held."""
        held = self._sessions.pop(session_id, None)
        if held is None:
            return False
        if held.timer is not None:
            held.timer.cancel()
        _call(held.release)
        return True

    def _expire(self, session_id: str) -> None:
        if session_id in self._sessions:
            logger.info("KV session %s expired before decode pulled it", session_id)
            self.drop(session_id)

    # ---- bootstrap mode (SGLang)
    async def send_bootstrap(
        self,
        room_id: int,
        payload: KvSessionPayload,
        release: Callable[[], None] | None = None,
        *,
        timeout: float | None = None,
    ) -> None:
        """Wait for the decode of ``room_id`` to register, then hand it ``payload``.

        ``release`` runs once on every outcome. Raises :class:`KvTransferFailed` when
        no decode registers within ``timeout`` (default ``bootstrap_timeout``), the
        room already has a prefill, or delivery fails. Cancellation tells a waiting
        decode that the transfer failed.
        """
        timeout = self.bootstrap_timeout if timeout is None else timeout
        room = self._rooms.get(room_id)
        if room is None:
            room = self._rooms[room_id] = _Room(asyncio.get_running_loop())
        if room.prefill != "none":
            _call(release)
            raise KvTransferFailed(f"bootstrap room {room_id} already has a prefill")
        room.prefill = "waiting"
        try:
            try:
                async with asyncio.timeout(timeout):
                    await asyncio.shield(room.registered)
            except TimeoutError:
                raise KvTransferFailed(
                    f"no decode registered for bootstrap room {room_id} within {timeout:g}s"
                ) from None
            if room.payload.done():
                raise KvTransferFailed(f"bootstrap room {room_id} was aborted")
            room.payload.set_result(payload)
            try:
                async with asyncio.timeout(timeout):
                    await asyncio.shield(room.delivered)
            except TimeoutError:
                raise KvTransferFailed(f"bootstrap room {room_id}: delivery to decode timed out") from None
        finally:
            if not room.payload.done():
                room.payload.set_exception(KvTransferFailed(f"prefill of bootstrap room {room_id} failed"))
            room.prefill = "done"
            self._settle(room_id, room)
            _call(release)

    def abort_room(self, room_id: int) -> bool:
        """Fail a bootstrap room (its prefill was aborted): the decode and ``send_bootstrap`` get KvTransferFailed."""
        room = self._rooms.get(room_id)
        if room is None or room.payload.done():
            return False
        err = KvTransferFailed(f"prefill of bootstrap room {room_id} was aborted")
        room.payload.set_exception(err)
        if not room.registered.done():  # wakes a prefill still waiting for its decode
            room.registered.set_exception(err)
        return True

    def _settle(self, room_id: int, room: _Room) -> None:
        if room.prefill != "waiting" and room.decode != "waiting" and self._rooms.get(room_id) is room:
            del self._rooms[room_id]
            for fut in (room.registered, room.payload, room.delivered):
                if fut.done() and not fut.cancelled():
                    fut.exception()  # mark retrieved

    # ---- connections
    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            try:
                async with asyncio.timeout(_REQUEST_TIMEOUT):
                    req = await _read(reader)
            except (TimeoutError, ValueError, asyncio.IncompleteReadError, msgspec.DecodeError) as err:
                logger.warning("KV transfer: bad request: %r", err)
                return
            op = req.get("op")
            if op == "pull":
                await self._serve_pull(str(req.get("session_id", "")), writer)
            elif op == "register" and isinstance(req.get("room"), int):
                await self._serve_register(req["room"], writer)
            else:
                await _write(writer, _fail(KvTransferFailed(f"unknown request {op!r}")))
        except (ConnectionError, asyncio.IncompleteReadError) as err:
            logger.warning("KV transfer connection lost: %r", err)
        finally:
            self._handlers.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _serve_pull(self, session_id: str, writer: asyncio.StreamWriter) -> None:
        held = self._sessions.pop(session_id, None)
        if held is None:
            await _write(
                writer, _fail(KvSessionNotFound(f"KV session {session_id!r} not found (expired or pulled)"))
            )
            return
        if held.timer is not None:
            held.timer.cancel()
        try:
            await _write(writer, _ok(held.payload))
        finally:
            _call(held.release)

    async def _serve_register(self, room_id: int, writer: asyncio.StreamWriter) -> None:
        room = self._rooms.get(room_id)
        if room is None:
            room = self._rooms[room_id] = _Room(asyncio.get_running_loop())
        if room.decode != "none":
            await _write(writer, _fail(KvTransferFailed(f"bootstrap room {room_id} already has a decode")))
            return
        room.decode = "waiting"
        try:
            if not room.registered.done():
                room.registered.set_result(None)
            try:
                async with asyncio.timeout(self.bootstrap_timeout):
                    payload = await asyncio.shield(room.payload)
            except TimeoutError:
                await _write(
                    writer,
                    _fail(
                        KvTransferFailed(
                            f"no prefill for bootstrap room {room_id} within {self.bootstrap_timeout:g}s"
                        )
                    ),
                )
                return
            except KvTransferError as err:
                await _write(writer, _fail(err))
                return
            try:
                await _write(writer, _ok(payload))
            except BaseException as err:
                if not room.delivered.done():
                    room.delivered.set_exception(KvTransferFailed(f"delivery to decode failed: {err!r}"))
                raise
            if not room.delivered.done():
                room.delivered.set_result(None)
        finally:
            room.decode = "done"
            self._settle(room_id, room)


# --------------------------------------------------------------------------- client


async def _request(host: str, port: int, msg: dict[str, Any], timeout: float) -> KvSessionPayload:
    try:
        async with asyncio.timeout(timeout):
            try:
                reader, writer = await asyncio.open_connection(host, port)
            except OSError as err:
                raise KvTransferFailed(
                    f"cannot connect to KV transfer endpoint {host}:{port}: {err}"
                ) from err
            try:
                await _write(writer, msg)
                reply = await _read(reader)
            except (OSError, ValueError, asyncio.IncompleteReadError, msgspec.DecodeError) as err:
                raise KvTransferFailed(f"KV transfer from {host}:{port} failed: {err!r}") from err
            finally:
                writer.close()
                with contextlib.suppress(Exception):
                    await writer.wait_closed()
    except TimeoutError:
        raise KvTransferFailed(f"KV transfer from {host}:{port} timed out after {timeout:g}s") from None
    if not reply.get("ok"):
        raise error_from_code(str(reply.get("code", "")), str(reply.get("message", "KV transfer failed")))
    try:
        return msgspec.convert(reply["session"], KvSessionPayload)
    except (KeyError, msgspec.ValidationError) as err:
        raise KvTransferFailed(f"malformed KV session from {host}:{port}: {err}") from err


async def pull_session(host: str, port: int, session_id: str, *, timeout: float = 10.0) -> KvSessionPayload:
    """Pull (and consume) a held session. Raises :class:`KvSessionNotFound` / :class:`KvTransferFailed`."""
    return await _request(host, port, {"op": "pull", "session_id": session_id}, timeout)


async def bootstrap_receive(host: str, port: int, room_id: int, *, timeout: float = 10.0) -> KvSessionPayload:
    """Register at the prefill's bootstrap server for ``room_id`` and wait for its blocks."""
    return await _request(host, port, {"op": "register", "room": room_id}, timeout)


async def fetch_session(locator: SessionLocator, *, timeout: float = 10.0) -> KvSessionPayload:
    """Pull or bootstrap-receive the session, then check block count and opaque state (KvTransferError)."""
    if locator.mode == "bootstrap":
        assert locator.room is not None
        payload = await bootstrap_receive(locator.host, locator.port, locator.room, timeout=timeout)
    else:
        payload = await pull_session(locator.host, locator.port, locator.session_id, timeout=timeout)
    if locator.expected_num_blocks is not None and payload.num_blocks != locator.expected_num_blocks:
        raise KvTransferFailed(
            f"KV block count mismatch: handoff names {locator.expected_num_blocks} blocks, "
            f"prefill sent {payload.num_blocks}"
        )
    if locator.opaque_digest is not None and payload.digest() != locator.opaque_digest:
        raise KvTransferFailed("KV blocks do not match the handoff's opaque state")
    return payload
