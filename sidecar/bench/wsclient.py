"""A lean WebSocket client for the load generator (RFC 6455 over a trio TCP stream).

The benchmark's client must cost little, or it steals the CPU it is measuring from on a
2-core machine: trio-websocket (wsproto) spends tens of µs per received message in pure
Python; this client parses a whole ``receive_some`` chunk of frames in one loop and hands
each payload to a callback synchronously (no channel, no task switch per message).

:class:`FrameParser` is the I/O-free part (unit-tested); :class:`WsClient` the thin I/O
shell: handshake, masked client frames, ping answers, close. Only what a benchmark needs:
no extensions, no TLS, no redirects.

Resources: one TCP connection; ``aclose`` closes it (idempotent). Sends are serialized
by a lock (many stream tasks share one connection). Errors: :class:`WsError`.
"""

from __future__ import annotations

import base64
import hashlib
import os
import urllib.parse
from collections.abc import Callable

import trio

OP_CONT, OP_TEXT, OP_BINARY, OP_CLOSE, OP_PING, OP_PONG = 0x0, 0x1, 0x2, 0x8, 0x9, 0xA
_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


class WsError(Exception):
    """Handshake refused, protocol violation, or the connection closed."""


class FrameParser:
    """Turns received bytes into complete messages ``(opcode, payload)``.

    Fragmented data messages are joined; control frames (close, ping, pong) are returned
    as they come, even between fragments. Masked server frames are unmasked.
    """

    __slots__ = ("_buf", "_frag_op", "_frags")

    def __init__(self) -> None:
        self._buf = bytearray()
        self._frag_op: int | None = None
        self._frags: list[bytes] = []

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        buf = self._buf
        buf += data
        out: list[tuple[int, bytes]] = []
        pos, end = 0, len(buf)
        while end - pos >= 2:
            b0, b1 = buf[pos], buf[pos + 1]
            n = b1 & 0x7F
            head = 2
            if n == 126:
                if end - pos < 4:
                    break
                n = int.from_bytes(buf[pos + 2 : pos + 4], "big")
                head = 4
            elif n == 127:
                if end - pos < 10:
                    break
                n = int.from_bytes(buf[pos + 2 : pos + 10], "big")
                head = 10
            masked = b1 & 0x80
            if masked:
                head += 4
            if end - pos < head + n:
                break
            payload = bytes(buf[pos + head : pos + head + n])
            if masked:
                payload = _mask(payload, bytes(buf[pos + head - 4 : pos + head]))
            pos += head + n
            op, fin = b0 & 0x0F, b0 & 0x80
            if op >= 0x8:
                out.append((op, payload))
            elif op == OP_CONT:
                if self._frag_op is None:
                    raise WsError("continuation frame without a first fragment")
                self._frags.append(payload)
                if fin:
                    out.append((self._frag_op, b"".join(self._frags)))
                    self._frag_op, self._frags = None, []
            elif fin:
                out.append((op, payload))
            else:
                self._frag_op, self._frags = op, [payload]
        del buf[:pos]
        return out


def _mask(payload: bytes, key: bytes) -> bytes:
    n = len(payload)
    if not n:
        return payload
    k = int.from_bytes((key * (n // 4 + 1))[:n], "little")
    return (int.from_bytes(payload, "little") ^ k).to_bytes(n, "little")


def encode_frame(opcode: int, payload: bytes, mask_key: bytes | None = None) -> bytes:
    """One final client frame of ``opcode`` (masked with ``mask_key``, random when None)."""
    key = os.urandom(4) if mask_key is None else mask_key
    n = len(payload)
    if n < 126:
        head = bytes((0x80 | opcode, 0x80 | n))
    elif n < 1 << 16:
        head = bytes((0x80 | opcode, 0x80 | 126)) + n.to_bytes(2, "big")
    else:
        head = bytes((0x80 | opcode, 0x80 | 127)) + n.to_bytes(8, "big")
    return head + key + _mask(payload, key)


class WsClient:
    """One client connection. ``run(on_message)`` reads until the connection closes."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self._stream = stream
        self._lock = trio.Lock()
        self._parser = FrameParser()
        self._pending = b""
        self.closed = False
        self.close_code: int | None = None

    @classmethod
    async def connect(cls, url: str, *, timeout: float = 10.0) -> WsClient:
        """Open ``ws://host:port/path?query`` and complete the handshake (raises WsError, OSError)."""
        parts = urllib.parse.urlsplit(url)
        if parts.scheme != "ws" or not parts.hostname:
            raise WsError(f"only ws:// URLs are supported, got {url!r}")
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        with trio.fail_after(timeout):
            stream = await trio.open_tcp_stream(parts.hostname, parts.port or 80)
            key = base64.b64encode(os.urandom(16))
            request = (
                f"GET {path} HTTP/1.1\r\nHost: {parts.netloc}\r\nUpgrade: websocket\r\n"
                f"Connection: Upgrade\r\nSec-WebSocket-Key: {key.decode()}\r\n"
                "Sec-WebSocket-Version: 13\r\n\r\n"
            )
            await stream.send_all(request.encode())
            response = b""
            while b"\r\n\r\n" not in response:
                chunk = await stream.receive_some(65536)
                if not chunk:
                    await stream.aclose()
                    raise WsError("connection closed during the handshake")
                response += chunk
        head, _, rest = response.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        if not lines[0].startswith("HTTP/1.1 101"):
            await stream.aclose()
            raise WsError(f"handshake refused: {lines[0]}")
        accept = base64.b64encode(hashlib.sha1(key + _GUID).digest()).decode()
        headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
        if headers.get("sec-websocket-accept") != accept:
            await stream.aclose()
            raise WsError("handshake: bad Sec-WebSocket-Accept")
        client = cls(stream)
        client._pending = rest
        return client

    async def send(self, payload: bytes | str) -> None:
        """Send one message (``bytes``: binary frame, ``str``: text frame)."""
        if isinstance(payload, str):
            frame = encode_frame(OP_TEXT, payload.encode())
        else:
            frame = encode_frame(OP_BINARY, payload)
        await self._send_raw(frame)

    async def send_many(self, payloads: list[bytes | str]) -> None:
        """Send several messages in one write (a client releasing many requests at once)."""
        frames = [
            encode_frame(OP_TEXT, p.encode()) if isinstance(p, str) else encode_frame(OP_BINARY, p)
            for p in payloads
        ]
        await self._send_raw(b"".join(frames))

    async def _send_raw(self, frame: bytes) -> None:
        if self.closed:
            raise WsError("connection closed")
        async with self._lock:
            try:
                await self._stream.send_all(frame)
            except (trio.BrokenResourceError, trio.ClosedResourceError) as err:
                self.closed = True
                raise WsError(f"send failed: {err}") from None

    async def run(self, on_message: Callable[[int, bytes], None]) -> None:
        """Read until the peer closes (or the stream breaks); ``on_message(opcode, payload)`` per
        data message. Answers pings and the peer's close. Returns normally when closed."""
        data, self._pending = self._pending, b""
        try:
            while True:
                if data:
                    for op, payload in self._parser.feed(data):
                        if op in (OP_TEXT, OP_BINARY):
                            on_message(op, payload)
                        elif op == OP_PING:
                            await self._send_raw(encode_frame(OP_PONG, payload))
                        elif op == OP_CLOSE:
                            self.close_code = (
                                int.from_bytes(payload[:2], "big") if len(payload) >= 2 else 1005
                            )
                            await self._close_reply()
                            return
                data = await self._stream.receive_some(262144)
                if not data:
                    return
        except (trio.BrokenResourceError, trio.ClosedResourceError, WsError):
            return
        finally:
            self.closed = True

    async def _close_reply(self) -> None:
        if not self.closed:
            with trio.move_on_after(1):
                try:
                    await self._send_raw(encode_frame(OP_CLOSE, (1000).to_bytes(2, "big")))
                except WsError:
                    pass
        self.closed = True
        await self._stream.aclose()

    async def close(self, code: int = 1000) -> None:
        """Start the closing handshake; ``run`` returns once the peer answers (or the TCP closes)."""
        if self.closed:
            return
        try:
            await self._send_raw(encode_frame(OP_CLOSE, code.to_bytes(2, "big")))
        except WsError:
            pass

    async def abort(self) -> None:
        """Drop the TCP connection without a closing handshake (a crashed client)."""
        self.closed = True
        await self._stream.aclose()

    async def aclose(self) -> None:
        self.closed = True
        await self._stream.aclose()
