"""A WebSocket client that writes raw frames (any bytes, any framing, invalid UTF-8) and
parses what the server sends with wsproto. For fuzzing a real sidecar."""

from __future__ import annotations

import collections
import urllib.parse

import trio
from wsproto import ConnectionType, WSConnection
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Event,
    RejectConnection,
    Request,
    TextMessage,
)

from tests.fuzz.mutate import Frame, ws_frame

NO_CLOSE_FRAME = 1006  # RFC 6455 §7.1.5: closed without a close frame


class Closed(Exception):
    """The server closed the connection: ``code`` from its close frame, or 1006."""

    def __init__(self, code: int, reason: str = "") -> None:
        super().__init__(f"closed {code} {reason}")
        self.code = code
        self.reason = reason


class RawWs:
    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.ws = WSConnection(ConnectionType.CLIENT)
        self.messages: collections.deque[str | bytes] = collections.deque()
        self.closed: Closed | None = None
        self._text: list[str] = []
        self._bytes: list[bytes] = []

    @classmethod
    async def connect(
        cls, url: str, headers: list[tuple[bytes, bytes]] | None = None, *, source: str | None = None
    ) -> RawWs:
        """Connect and complete the handshake; ``source``: the local address to connect from
        (any of 127.0.0.0/8 on loopback: another peer address for the sidecar)."""
        parts = urllib.parse.urlsplit(url)
        stream = await trio.open_tcp_stream(
            parts.hostname or "127.0.0.1", parts.port or 80, local_address=source
        )
        self = cls(stream)
        try:
            await stream.send_all(
                self.ws.send(
                    Request(host=parts.netloc, target=parts.path or "/", extra_headers=headers or [])
                )
            )
            while True:
                events, eof = await self._receive()
                for event in events:
                    if isinstance(event, AcceptConnection):
                        return self
                    if isinstance(event, RejectConnection):
                        raise Closed(event.status_code, "handshake rejected")
                if eof:
                    raise Closed(NO_CLOSE_FRAME, "closed during the handshake")
        except BaseException:
            await trio.aclose_forcefully(stream)
            raise

    async def _receive(self) -> tuple[list[Event], bool]:
        """Events from the next chunk of bytes, and whether the server closed TCP."""
        data = await self.stream.receive_some(65536)
        self.ws.receive_data(data or None)
        return list(self.ws.events()), not data

    async def send(self, frame: Frame) -> None:
        """Write ``frame`` as is (the server may already have closed: then nothing happens)."""
        try:
            await self.stream.send_all(
                frame.raw if frame.raw is not None else ws_frame(frame.opcode, frame.payload)
            )
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    async def send_text(self, text: str) -> None:
        await self.send(Frame(0x1, text.encode(), "text"))

    async def next(self) -> str | bytes:
        """The next complete message; raises :class:`Closed` once the server has closed."""
        while not self.messages:
            if self.closed is not None:
                raise self.closed
            try:
                events, eof = await self._receive()
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                events, eof = [], True
            for event in events:
                if isinstance(event, TextMessage):
                    self._text.append(event.data)
                    if event.message_finished:
                        self.messages.append("".join(self._text))
                        self._text = []
                elif isinstance(event, BytesMessage):
                    self._bytes.append(bytes(event.data))
                    if event.message_finished:
                        self.messages.append(b"".join(self._bytes))
                        self._bytes = []
                elif isinstance(event, CloseConnection):
                    self.closed = Closed(event.code, event.reason or "")
                    try:  # answer the close handshake, as a well-behaved client does
                        await self.stream.send_all(self.ws.send(event.response()))
                    except Exception:  # the server may be gone already
                        pass
            if eof and self.closed is None:
                self.closed = Closed(NO_CLOSE_FRAME, "closed without a close frame")
        return self.messages.popleft()

    async def aclose(self) -> None:
        with trio.move_on_after(1):
            await self.send(Frame(0x8, (1000).to_bytes(2, "big"), "close"))
        await self.stream.aclose()
