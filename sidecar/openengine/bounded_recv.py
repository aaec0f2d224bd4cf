"""A size bound on server-stream messages, checked before the message is read.

grpclib reads a whole message into memory — acknowledging it to the engine's flow control
as it goes — before decoding it, and the gRPC length prefix may announce up to 4 GiB.
:func:`recv_bounded` is grpclib's ``Stream.recv_message`` with that prefix checked first.
It uses grpclib 0.4's stream internals (the version the lock file pins;
``tests/openengine/test_bounded_recv.py`` holds the behaviour).
"""

from __future__ import annotations

import time
from typing import Any

from grpclib.client import Stream

from sidecar.openengine.errors import EngineMessageTooLarge, EngineProtocolError


async def recv_bounded(stream: Stream[Any, Any], limit: int) -> Any | None:
    """The next message of ``stream`` (``None`` at its end); :class:`EngineMessageTooLarge`
    when its length prefix exceeds ``limit`` bytes
    (:mod:`sidecar.openengine.errors`)."""
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
        (message,) = await st._dispatch.recv_message(st._codec.decode(data, st._recv_type))
        st._messages_received += 1
        st._stream.connection.messages_received += 1
        st._stream.connection.last_message_received = time.monotonic()
        return message
