"""gRPC over HTTP/2, the parts the trio-native transport (:mod:`sidecar.openengine.trio_h2`)
needs beside h2: the length-prefixed message framing with its size bound, and the reading of
response headers and trailers into a gRPC status (gRPC's PROTOCOL-HTTP2 and
http-grpc-status-mapping; the same readings as grpclib's client, so both transports raise the
same typed errors: tests/openengine/test_transport_errors.py).
"""

from __future__ import annotations

from urllib.parse import unquote

#: Largest response header list (bytes, as HPACK counts them) we accept.
MAX_HEADER_LIST = 64 * 1024
#: Largest gRPC message a connection accepts unless told otherwise.
MAX_MESSAGE = 4 * 1024 * 1024

# gRPC statuses used here (numbers: the gRPC spec)
UNKNOWN, INTERNAL, UNIMPLEMENTED, UNAVAILABLE = 2, 13, 12, 14
PERMISSION_DENIED, UNAUTHENTICATED = 7, 16
#: HTTP status of a non-gRPC answer -> gRPC status (gRPC's http-grpc-status-mapping, as grpclib).
HTTP_TO_GRPC = {
    b"400": INTERNAL,
    b"401": UNAUTHENTICATED,
    b"403": PERMISSION_DENIED,
    b"404": UNIMPLEMENTED,
    b"429": UNAVAILABLE,
    b"502": UNAVAILABLE,
    b"503": UNAVAILABLE,
    b"504": UNAVAILABLE,
}


class CallError(Exception):
    """A call failed. ``status``: the gRPC status number (None when the stream or connection was
    lost: ``lost`` True); ``message``: the engine's (or our) text; ``too_large``: the (announced
    size, limit) of a message refused from its length prefix."""

    def __init__(
        self,
        message: str,
        status: int | None = None,
        *,
        lost: bool = False,
        too_large: tuple[int, int] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.lost = lost
        self.too_large = too_large


class TooLarge(Exception):
    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"engine message of {size} bytes exceeds the limit of {limit} bytes")
        self.size, self.limit = size, limit


class MessageReader:
    """gRPC length-prefixed messages out of DATA payloads; the prefix is checked against
    ``limit`` before the message's bytes are kept."""

    __slots__ = ("_buf", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._buf = b""

    @property
    def pending(self) -> int:
        """Bytes of an incomplete message held."""
        return len(self._buf)

    def feed(self, data: bytes) -> list[bytes]:
        if self._buf:
            data = self._buf + data
        out = []
        pos, n = 0, len(data)
        while n - pos >= 5:
            if data[pos]:
                raise CallError("engine sent a compressed message (not negotiated)")
            size = int.from_bytes(data[pos + 1 : pos + 5], "big")
            if size > self.limit:
                raise TooLarge(size, self.limit)
            end = pos + 5 + size
            if end > n:
                break
            out.append(data[pos + 5 : end])
            pos = end
        self._buf = data[pos:] if pos < n else b""
        return out


def header_map(block: list[tuple[bytes, bytes]]) -> dict[bytes, bytes]:
    return dict(block)


def grpc_status(headers: dict[bytes, bytes]) -> tuple[int, str]:
    """``(status, message)`` of a trailer block (a missing or bad ``grpc-status``: UNKNOWN)."""
    raw = headers.get(b"grpc-status")
    if raw is None:
        return UNKNOWN, "Missing grpc-status header"
    try:
        status = int(raw)
    except ValueError:
        return UNKNOWN, f"Invalid grpc-status: {raw.decode('latin-1')!r}"
    message = headers.get(b"grpc-message", b"")
    if message:
        return status, unquote(message.decode("latin-1"), encoding="utf-8", errors="replace")
    return status, ""


def response_problem(headers: dict[bytes, bytes]) -> tuple[int, str] | None:
    """Why response headers are not a gRPC answer (``:status``, ``content-type``), or None."""
    status = headers.get(b":status")
    if status != b"200":
        text = status.decode("latin-1") if status is not None else None
        return HTTP_TO_GRPC.get(status or b"", UNKNOWN), f"Received :status = {text!r}"
    ctype = headers.get(b"content-type")
    if ctype is None:
        return UNKNOWN, "Missing content-type header"
    base, _, sub = ctype.partition(b"+")
    if base != b"application/grpc" or (sub or b"proto") != b"proto":
        return UNKNOWN, f"Invalid content-type: {ctype.decode('latin-1')!r}"
    return None


__all__ = [
    "HTTP_TO_GRPC",
    "MAX_HEADER_LIST",
    "MAX_MESSAGE",
    "CallError",
    "MessageReader",
    "TooLarge",
    "grpc_status",
    "header_map",
    "response_problem",
]
