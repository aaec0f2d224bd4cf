"""Generate streams on the trio-native transport (``--engine-transport trio``): the request's
HTTP/2 headers, and the source an :class:`~sidecar.openengine.client.EngineStream` reads from
(a :class:`~sidecar.openengine.trio_h2.Call` in place of the grpclib pump's memory channel).

No task and no event-loop hop per stream: the caller's own task takes each message from the
call and decodes it (a large one in a worker thread, :mod:`sidecar.openengine.message_limits`).
Failures become the same typed errors as on the grpclib transport
(:mod:`sidecar.openengine.errors`): a gRPC status -> :class:`EngineStatusError`, a lost stream
or connection -> :class:`EngineUnavailable`, a message over its bound ->
:class:`EngineMessageTooLarge`, an undecodable one -> :class:`EngineProtocolError`.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from grpclib.const import Status
from grpclib.metadata import USER_AGENT, encode_metadata, encode_timeout

from sidecar.openengine.errors import (
    STATUS_TO_CODE,
    EngineMessageTooLarge,
    EngineProtocolError,
    EngineStatusError,
    EngineUnavailable,
)
from sidecar.openengine.trio_h2 import Call, CallError
from sidecar.openengine.trio_pool import ConnectionPool

__all__ = ["CallSource", "OpenCall", "RequestHead", "call_error"]


class RequestHead:
    """The HTTP/2 header list of one gRPC route on one engine (the fixed part built once)."""

    def __init__(self, authority: str, path: str) -> None:
        self._fixed = [
            (b":method", b"POST"),
            (b":scheme", b"http"),
            (b":path", path.encode("ascii")),
            (b":authority", authority.encode("ascii")),
            (b"te", b"trailers"),
            (b"content-type", b"application/grpc+proto"),
            (b"user-agent", USER_AGENT.encode("ascii")),
        ]

    def headers(
        self, timeout: float | None, metadata: list[tuple[str, str]] | None
    ) -> list[tuple[bytes, bytes]]:
        """The headers of one call: ``grpc-timeout`` when ``timeout`` is given, then the metadata
        (checked and encoded as grpclib does)."""
        if timeout is None and not metadata:
            return self._fixed
        headers = list(self._fixed)
        if timeout is not None:
            headers.append((b"grpc-timeout", encode_timeout(timeout).encode("ascii")))
        if metadata:
            headers += [(k.encode("ascii"), v.encode("ascii")) for k, v in encode_metadata(metadata)]
        return headers


def call_error(err: CallError, what: str = "Generate") -> BaseException:
    """A failed call as one of our typed errors (a ``DEADLINE_EXCEEDED`` while the caller has a
    deadline: the client's ``_DeadlineHit``, so the caller's own scope fires)."""
    if err.too_large is not None:
        return EngineMessageTooLarge(*err.too_large)
    if err.status is not None:
        try:
            name = Status(err.status).name
        except ValueError:
            name, message = "UNKNOWN", f"Invalid grpc-status: {err.status!r}"
            return EngineStatusError(name, 2, message, STATUS_TO_CODE.get(name))
        if name == "DEADLINE_EXCEEDED" and not math.isinf(trio.current_effective_deadline()):
            from sidecar.openengine.client import _DeadlineHit

            return _DeadlineHit()
        return EngineStatusError(name, err.status, err.message, STATUS_TO_CODE.get(name))
    if err.lost:
        return EngineUnavailable(f"{what}: engine unreachable or connection lost ({err.message})")
    return EngineProtocolError(f"{what}: {err.message}")


class CallSource:
    """What an ``EngineStream`` receives from, filled by a :class:`Call`: ``receive()`` gives the
    next decoded message, raises ``trio.EndOfChannel`` at the end (a failure first goes to
    ``stream._failure``, as the grpclib pump does); ``close()`` does nothing (leaving the stream's
    block cancels the call)."""

    __slots__ = ("_call", "_decode", "_decode_large", "_failure", "_inline_max", "stream")

    def __init__(
        self,
        call: Call | None,
        failure: BaseException | None,
        decode: Callable[[bytes], Any],
        decode_large: Callable[[bytes], Awaitable[Any]],
        inline_max: int,
    ) -> None:
        self._call = call
        self._failure = failure  # the call could not start: given at the first step
        self._decode = decode
        self._decode_large = decode_large
        self._inline_max = inline_max
        self.stream: Any = None  # the EngineStream reading from here

    def _end(self, failure: BaseException | None) -> trio.EndOfChannel:
        self._call = None
        if failure is not None and self.stream._failure is None:
            self.stream._failure = failure
        return trio.EndOfChannel()

    async def receive(self) -> Any:
        call = self._call
        if call is None:
            await trio.lowlevel.checkpoint()
            failure, self._failure = self._failure, None
            raise self._end(failure)
        try:
            data = await call.receive()
        except CallError as err:
            raise self._end(call_error(err)) from None
        if data is None:
            raise self._end(None)
        try:
            if len(data) > self._inline_max:
                return await self._decode_large(data)
            return self._decode(data)
        except Exception as err:  # betterproto2 raises assorted errors on malformed protobuf
            call.cancel()
            raise self._end(
                EngineProtocolError(
                    f"Generate: engine sent something undecodable ({type(err).__name__}: {err})"
                )
            ) from None

    @property
    def ready(self) -> bool:
        """The next :meth:`receive` needs no wait for the engine."""
        return self._call is None or self._call.ready

    def close(self) -> None:
        return None


class OpenCall:
    """``async with OpenCall(pool, headers, body, decode, decode_large, inline_max) as source``:
    a call on a connection of ``pool``, as a :class:`CallSource`. Entering never fails: a call
    that cannot start fails at the first ``receive``. Leaving resets the stream unless it ended
    (RST_STREAM queued synchronously) and gives its place in the pool back.

    A class rather than an ``asynccontextmanager``: one per request, and trio registers every
    async generator it runs (docs/PERFORMANCE.md, optimisation 14)."""

    __slots__ = ("_body", "_call", "_decode", "_decode_large", "_headers", "_inline_max", "_pool", "_release")

    def __init__(
        self,
        pool: ConnectionPool | None,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        decode: Callable[[bytes], Any],
        decode_large: Callable[[bytes], Awaitable[Any]],
        inline_max: int,
    ) -> None:
        self._pool = pool
        self._headers = headers
        self._body = body
        self._decode = decode
        self._decode_large = decode_large
        self._inline_max = inline_max
        self._call: Call | None = None
        self._release: Callable[[], None] | None = None

    async def __aenter__(self) -> CallSource:
        failure: BaseException | None = None
        try:
            if self._pool is None:
                raise CallError("engine client is closed or was not opened by open_engine_client", lost=True)
            conn, self._release = await self._pool.acquire()
            self._call = conn.start_call(self._headers, self._body)
        except CallError as err:
            failure = call_error(err)
        except BaseException:
            self._leave()
            raise
        return CallSource(self._call, failure, self._decode, self._decode_large, self._inline_max)

    async def __aexit__(self, *exc_info: object) -> None:
        self._leave()

    def _leave(self) -> None:
        if self._call is not None:
            self._call.cancel()
        if self._release is not None:
            self._release()
