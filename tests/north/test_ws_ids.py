"""Stream and call ids on one connection (docs/PROTOCOL.md, "Ids"): a ``generate`` / ``call``
reusing the id of a stream / call still open gets a ``protocol_error`` naming that id and
nothing else -- the open one goes on and gets the only ``end`` / ``result`` of its id. A real
WebSocket against the north plane, with a host whose streams and calls wait for the test."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import pytest
import trio
from trio_websocket import WebSocketConnection, open_websocket

from sidecar.core.lifecycle import OUTCOME_COMPLETED, Outcome, StreamHandle
from sidecar.north.ws_server import NorthPlane, WsConfig
from sidecar.openengine import pb

REQUEST = {"model": "m", "prompt": "hi"}


class GatedHost:
    """Admits anything; a stream (keyed by its prompt) or call (by its method) records that it
    started, then waits until the test sets its gate."""

    def __init__(self) -> None:
        self.gates: dict[Any, trio.Event] = {}
        self.began: dict[Any, trio.Event] = {}
        self.started: list[Any] = []

    def gate(self, key: Any) -> trio.Event:
        return self.gates.setdefault(key, trio.Event())

    async def wait_started(self, key: Any) -> None:
        await self.began.setdefault(key, trio.Event()).wait()

    def _start(self, key: Any) -> trio.Event:
        self.started.append(key)
        self.began.setdefault(key, trio.Event()).set()
        return self.gate(key)

    def admit(
        self, request: pb.GenerateRequest, metadata: dict[str, str], *, kv_session_bytes: bytes | None = None
    ) -> StreamHandle:
        return StreamHandle(request=request)

    async def run_stream(
        self, handle: StreamHandle, emit: Callable[[pb.GenerateResponse], Awaitable[None]]
    ) -> Outcome:
        await self._start(("stream", handle.request.prompt)).wait()
        await emit(pb.GenerateResponse(request_id="r", token=pb.TokenOutput(output_index=0, text="x")))
        return OUTCOME_COMPLETED

    async def call(self, method: str, request: Any, *, owner: object = None) -> Any:
        await self._start(("call", method)).wait()
        return {"method": method}


async def _next(ws: WebSocketConnection, *, text: bool = True) -> dict[str, Any]:
    """The next message; ``text``: whether it must come as a text (JSON) or binary (msgpack) frame."""
    raw = await ws.get_message()
    assert isinstance(raw, str) == text
    msg: dict[str, Any] = json.loads(raw) if isinstance(raw, str) else msgspec.msgpack.decode(raw)
    return msg


@pytest.mark.parametrize("stream", [1, "s"])
async def test_generate_reusing_an_open_stream_id_gets_one_protocol_error_and_no_end(stream: Any) -> None:
    host = GatedHost()
    plane = NorthPlane(host, WsConfig())  # type: ignore[arg-type]
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(plane.serve, "127.0.0.1", 0)
            async with open_websocket("127.0.0.1", port, "/v1/ws", use_ssl=False) as ws:
                first = {"type": "generate", "stream": stream, "request": {**REQUEST, "prompt": "first"}}
                await ws.send_message(json.dumps(first))
                await host.wait_started(("stream", "first"))
                reuses = [
                    json.dumps({**first, "request": {**REQUEST, "prompt": "second"}}),  # valid
                    json.dumps({**first, "request": {"prompt": 1}}),  # invalid, same id
                    json.dumps({**first, "metadata": {"k": 1}}),  # invalid metadata, same id
                    msgspec.msgpack.encode({**first, "request": {**REQUEST, "prompt": "third"}}),
                ]
                for frame in reuses:
                    await ws.send_message(frame)
                    reply = await _next(ws, text=isinstance(frame, str))  # in the frame's encoding
                    assert reply == {
                        "type": "protocol_error",
                        "message": f"stream {stream!r} is already open: generate refused",
                        "stream": stream,
                    }
                host.gate(("stream", "first")).set()
                got = [await _next(ws), await _next(ws)]
                assert [m["type"] for m in got] == ["event", "end"]
                assert got[1] == {"type": "end", "stream": stream, "outcome": "completed", "error": None}
                assert host.started == [("stream", "first")]  # the reuses never reached the host
                # ended: the id is free again
                await ws.send_message(json.dumps({**first, "request": {**REQUEST, "prompt": "again"}}))
                host.gate(("stream", "again")).set()
                got = [await _next(ws), await _next(ws)]
                assert [(m["type"], m["stream"]) for m in got] == [("event", stream), ("end", stream)]
            nursery.cancel_scope.cancel()


async def test_call_reusing_an_id_in_flight_gets_one_protocol_error_and_no_result() -> None:
    host = GatedHost()
    plane = NorthPlane(host, WsConfig())  # type: ignore[arg-type]
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(plane.serve, "127.0.0.1", 0)
            async with open_websocket("127.0.0.1", port, "/v1/ws", use_ssl=False) as ws:
                await ws.send_message(json.dumps({"type": "call", "call": 7, "method": "health"}))
                await host.wait_started(("call", "health"))
                await ws.send_message(json.dumps({"type": "call", "call": 7, "method": "describe"}))
                assert await _next(ws) == {
                    "type": "protocol_error",
                    "message": "call 7 is still in flight: call refused",
                    "call": 7,
                }
                # an invalid call with that id: refused the same way (not a failed result for 7)
                await ws.send_message(json.dumps({"type": "call", "call": 7, "method": "nope"}))
                assert (await _next(ws))["call"] == 7
                # a generate may use the same value: stream and call ids are separate
                await ws.send_message(json.dumps({"type": "generate", "stream": 7, "request": REQUEST}))
                host.gate(("call", "health")).set()
                assert await _next(ws) == {
                    "type": "result",
                    "call": 7,
                    "ok": True,
                    "body": {"method": "health"},
                }
                assert host.started == [("call", "health"), ("stream", "hi")]
                # answered: the id is free again
                await ws.send_message(json.dumps({"type": "call", "call": 7, "method": "load"}))
                host.gate(("call", "load")).set()
                assert await _next(ws) == {
                    "type": "result",
                    "call": 7,
                    "ok": True,
                    "body": {"method": "load"},
                }
                host.gate(("stream", "hi")).set()
                assert [(await _next(ws))["type"] for _ in range(2)] == ["event", "end"]
            nursery.cancel_scope.cancel()
