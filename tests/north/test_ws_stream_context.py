"""A WebSocket stream hands its stream number to the core for the stream's log records
(``StreamHandle.log_fields``; the core adds the request id: tests/core/test_lifecycle.py)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio

from sidecar.core.lifecycle import OUTCOME_COMPLETED, Outcome, StreamHandle
from sidecar.north.codec import Encoding
from sidecar.north.peers import Peer
from sidecar.north.ws_server import Connection, WsConfig
from sidecar.openengine import pb
from tests.north.test_ws_queue import StuckSocket


class Host:
    """Runs no engine: records what the stream's handle carried when the core got it."""

    def __init__(self) -> None:
        self.fields: list[dict[str, object] | None] = []

    async def run_stream(
        self, handle: StreamHandle, emit: Callable[[pb.GenerateResponse], Awaitable[None]]
    ) -> Outcome:
        self.fields.append(handle.log_fields)
        return OUTCOME_COMPLETED


async def test_the_stream_number_reaches_the_core_for_its_logs() -> None:
    host = Host()
    sock = StuckSocket()
    conn = Connection(sock, host, WsConfig(), peer=Peer("p", "10.0.0.1:5"))  # type: ignore[arg-type]
    handle = StreamHandle(pb.GenerateRequest(request_id="r1", model="m", prompt="hi"))
    conn.streams[3] = handle
    with trio.fail_after(5):
        await conn._run_stream(3, Encoding.JSON, handle)
    assert host.fields == [{"stream": 3}]
    assert 3 not in conn.streams
