"""A size bound on every message the client receives, checked before the message is read.

grpclib reads a whole message into memory — acknowledging it to the engine's flow control
as it goes — before decoding it, and the gRPC length prefix may announce up to 4 GiB.
:func:`recv_bounded` is grpclib's ``Stream.recv_message`` with that prefix checked first, and
with a large message's decoding handed to the caller's ``decode_large`` (a worker thread:
:mod:`sidecar.openengine.message_limits`). Per message it costs what grpclib's own does plus
one comparison. It uses grpclib 0.4's stream internals (the version the lock file pins;
``tests/openengine/test_bounded_recv.py`` holds the behaviour).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from grpclib.client import Stream

from sidecar.openengine.errors import EngineMessageTooLarge, EngineProtocolError

#: ``await decode_large(codec_decode, data, message_type)``: decode a large message elsewhere.
DecodeLarge = Callable[[Callable[[bytes, Any], Any], bytes, Any], Awaitable[Any]]


async def recv_bounded(
    stream: Stream[Any, Any], limit: int, decode_large: DecodeLarge | None = None, inline_max: int = 0
) -> Any | None:
    """The next message of ``stream`` (``None`` at its end); :class:`EngineMessageTooLarge`
    when its length prefix exceeds ``limit`` bytes (:mod:`sidecar.openengine.errors`). A
    message over ``inline_max`` bytes is decoded by ``decode_large`` when given."""
    st: Any = stream
    if not st._recv_initial_metadata_done:
        await st.recv_initial_metadata()
    with st._wrapper:
        prefix = await st._stream.recv_data(5)
        if not prefix:
            return None
        if prefix[0]:
            raise EngineProtocolError("engine sent a compressed message (not negotiated)")
        size = int.from_bytes(prefix[1:5], "big")
        if size > limit:
            raise EngineMessageTooLarge(size, limit)
        data = await st._stream.recv_data(size)
        if len(data) != size:
            raise EngineProtocolError(f"engine ended a message after {len(data)} of {size} bytes")
        if size > inline_max and decode_large is not None:
            decoded = await decode_large(st._codec.decode, data, st._recv_type)
        else:
            decoded = st._codec.decode(data, st._recv_type)
        (message,) = await st._dispatch.recv_message(decoded)
        st._messages_received += 1
        st._stream.connection.messages_received += 1
        st._stream.connection.last_message_received = time.monotonic()
        return message
