"""gRPC over HTTP/2, the parts above the framing (gRPC's PROTOCOL-HTTP2 and
http-grpc-status-mapping documents): a call's request headers, the length-prefixed message
framing with its size bound, and the reading of response headers and trailers into a status.

I/O-free; :mod:`sidecar.openengine.transport.connection` uses it for every call.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Sequence
from urllib.parse import unquote

from sidecar import __version__

#: Largest response header list (bytes, as HPACK counts them) we accept.
MAX_HEADER_LIST = 64 * 1024
#: Largest gRPC message a connection accepts unless told otherwise.
MAX_MESSAGE = 4 * 1024 * 1024

# gRPC statuses used here (numbers: the gRPC spec)
UNKNOWN, INVALID_ARGUMENT, INTERNAL, UNIMPLEMENTED, UNAVAILABLE = 2, 3, 13, 12, 14
PERMISSION_DENIED, UNAUTHENTICATED = 7, 16
#: HTTP status of a non-gRPC answer -> gRPC status (gRPC's http-grpc-status-mapping).
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

#: Our ``user-agent`` (gRPC's form: ``grpc-<language>-<implementation>/<version>``).
USER_AGENT = f"grpc-python-openengine-sidecar/{__version__}"

Headers = list[tuple[bytes, bytes]]


class CallError(Exception):
    """A call failed. ``status``: the gRPC status number (None when the stream or connection was
    lost: ``lost`` True, or the engine broke the protocol on this stream); ``message``: the
    engine's (or our) text; ``too_large``: the (announced size, limit) of a message refused from
    its length prefix."""

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
    """A message's length prefix announced more than the reader's limit."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"engine message of {size} bytes exceeds the limit of {limit} bytes")
        self.size, self.limit = size, limit


class MessageReader:
    """gRPC length-prefixed messages out of DATA payloads. Each prefix is checked against
    ``limit`` before the message's bytes are kept; a message arriving in many frames is joined
    once, when complete (work linear in its size)."""

    __slots__ = ("_chunks", "_held", "_need", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._chunks: list[bytes] = []  # bytes of an incomplete message (prefix included)
        self._held = 0  # their total length
        self._need = 0  # the complete message's length with its prefix, once the prefix is known

    @property
    def pending(self) -> int:
        """Bytes of an incomplete message held."""
        return self._held

    def feed(self, data: bytes) -> list[bytes]:
        """The messages completed by ``data`` (possibly none). Raises :class:`TooLarge` for a
        prefix over the limit and :class:`CallError` for a compressed message."""
        if self._held:
            self._chunks.append(data)
            self._held += len(data)
            if self._need == 0 and self._held >= 5:  # the prefix just became whole
                self._need = self._prefix(b"".join(self._chunks)[:5], 0)
            if self._need == 0 or self._held < self._need:
                return []
            data = b"".join(self._chunks)
            self._chunks, self._held, self._need = [], 0, 0
        out: list[bytes] = []
        pos, n = 0, len(data)
        while n - pos >= 5:
            end = pos + self._prefix(data, pos)
            if end > n:
                self._need = end - pos
                break
            out.append(data[pos + 5 : end])
            pos = end
        if pos < n:
            rest = data[pos:]
            self._chunks, self._held = [rest], len(rest)
        return out

    def _prefix(self, data: bytes, pos: int) -> int:
        """The length (with its 5-byte prefix) of the message whose prefix starts at ``pos``."""
        if data[pos]:
            raise CallError("engine sent a compressed message (not negotiated)")
        size = int.from_bytes(data[pos + 1 : pos + 5], "big")
        if size > self.limit:
            raise TooLarge(size, self.limit)
        return size + 5


def header_map(block: Sequence[tuple[bytes, bytes]]) -> dict[bytes, bytes]:
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


# -- request headers ---------------------------------------------------------------------------

_KEY = re.compile(r"[0-9a-z_.\-]+")
_VALUE = re.compile(r"[ -~]*")  # printable ASCII
#: Request headers gRPC reserves for itself (HTTP/2 and gRPC's own): never metadata.
_RESERVED = frozenset({"te", "content-type", "user-agent", "host", "connection"})


def encode_timeout(seconds: float) -> bytes:
    """``grpc-timeout``'s value: at most 8 digits and a unit (gRPC's PROTOCOL-HTTP2)."""
    for unit, scale in ((b"n", 1e9), (b"u", 1e6), (b"m", 1e3), (b"S", 1.0), (b"M", 1 / 60), (b"H", 1 / 3600)):
        value = int(seconds * scale)
        if value < 100_000_000:
            return str(max(value, 1) if seconds > 0 else 0).encode("ascii") + unit
    return b"99999999H"


def encode_metadata(metadata: Sequence[tuple[str, str]]) -> Headers:
    """Custom metadata as header fields. Raises ``ValueError`` for a key gRPC does not allow
    (reserved, ``grpc-``, pseudo, not ``[0-9a-z_.-]``) or a value that is not printable ASCII;
    ``-bin`` keys carry their value's UTF-8 bytes base64-encoded (unpadded)."""
    out: Headers = []
    for key, value in metadata:
        if key in _RESERVED or key.startswith("grpc-") or not _KEY.fullmatch(key):
            raise ValueError(f"invalid gRPC metadata key {key!r}")
        if key.endswith("-bin"):
            out.append((key.encode("ascii"), base64.b64encode(value.encode("utf-8")).rstrip(b"=")))
            continue
        if not _VALUE.fullmatch(value):
            raise ValueError(f"invalid gRPC metadata value for {key!r}")
        out.append((key.encode("ascii"), value.encode("ascii")))
    return out


class RequestHead:
    """The HTTP/2 header list of one gRPC route on one engine (the fixed part built once)."""

    __slots__ = ("_fixed",)

    def __init__(self, authority: str, path: str) -> None:
        self._fixed: Headers = [
            (b":method", b"POST"),
            (b":scheme", b"http"),
            (b":path", path.encode("ascii")),
            (b":authority", authority.encode("ascii")),
            (b"te", b"trailers"),
            (b"content-type", b"application/grpc+proto"),
            (b"user-agent", USER_AGENT.encode("ascii")),
        ]

    def headers(self, timeout: float | None, metadata: Sequence[tuple[str, str]] | None) -> Headers:
        """The headers of one call: ``grpc-timeout`` when ``timeout`` is given, then the
        metadata (:func:`encode_metadata`; raises ``ValueError`` for what gRPC does not allow)."""
        if timeout is None and not metadata:
            return self._fixed
        headers = list(self._fixed)
        if timeout is not None:
            headers.append((b"grpc-timeout", encode_timeout(timeout)))
        if metadata:
            headers += encode_metadata(metadata)
        return headers


__all__ = [
    "HTTP_TO_GRPC",
    "MAX_HEADER_LIST",
    "MAX_MESSAGE",
    "USER_AGENT",
    "CallError",
    "Headers",
    "MessageReader",
    "RequestHead",
    "TooLarge",
    "encode_metadata",
    "encode_timeout",
    "grpc_status",
    "header_map",
    "response_problem",
]
