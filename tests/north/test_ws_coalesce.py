"""Server-side coalescing (docs/PROTOCOL.md, "Coalesced events"): only for a client that
connected with ``coalesce=1``; runs of queued ``event`` frames become one ``events`` frame,
order kept, ``end`` / ``result`` / ``protocol_error`` never merged."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import pytest
import trio
from trio_websocket import ConnectionClosed, open_websocket

from sidecar.client.sidecar_client import open_sidecar
from sidecar.core.errors import Rejection
from sidecar.core.lifecycle import OUTCOME_COMPLETED, Outcome, StreamHandle
from sidecar.north import codec, wire
from sidecar.north.codec import Encoding, EventEncoder
from sidecar.north.ws_server import NorthPlane, WsConfig, coalesce_queued, final
from sidecar.openengine import pb

EVENTS = 40


def _token(i: int) -> pb.GenerateResponse:
    return pb.GenerateResponse(
        request_id="r", token=pb.TokenOutput(output_index=0, tokens=[pb.TokenInfo(token_id=i)], text=f"t{i}")
    )


def _decode(frame: str | bytes) -> Any:
    # final() frames are str / bytes subclasses, which msgspec does not take
    return codec.decode_server_frame(str(frame) if isinstance(frame, str) else bytes(frame))


def _flatten(frames: list[str | bytes]) -> list[Any]:
    out: list[Any] = []
    for frame in frames:
        msg = _decode(frame)
        out.extend(msg.items if isinstance(msg, wire.Events) else [msg])
    return out


def _events(stream: int, encoding: Encoding, n: int, start: int = 0) -> list[str | bytes]:
    enc = EventEncoder(stream, encoding)
    return [enc.encode(_token(i)) for i in range(start, start + n)]


def _end(stream: int, encoding: Encoding) -> str | bytes:
    return final(codec.encode(codec.end_message(stream, "completed"), encoding))


@pytest.mark.parametrize("encoding", list(Encoding))
def test_runs_merge_finals_stay_in_place(encoding: Encoding) -> None:
    queued = [
        *_events(1, encoding, 3),
        *_events(2, encoding, 2),
        _end(1, encoding),
        *_events(2, encoding, 1, start=2),
        _end(2, encoding),
        final(codec.encode(wire.ProtocolErrorMessage(message="x"), encoding)),
    ]
    out = coalesce_queued(queued)
    kinds = [type(_decode(f)).__name__ for f in out]
    assert kinds == ["Events", "End", "Event", "End", "ProtocolErrorMessage"]
    assert _flatten(out) == _flatten(queued)
    assert len(_decode(out[0]).items) == 5


def test_a_change_of_encoding_ends_a_run_and_size_is_bounded() -> None:
    queued = [
        *_events(1, Encoding.JSON, 2),
        *_events(2, Encoding.MSGPACK, 2),
        *_events(1, Encoding.JSON, 2, 2),
    ]
    out = coalesce_queued(queued)
    assert [type(f) for f in out] == [str, bytes, str]
    assert _flatten(out) == _flatten(queued)
    many = _events(1, Encoding.JSON, 100)
    bound = sum(len(f) for f in many[:10])
    out = coalesce_queued(many, max_bytes=bound)
    assert 10 <= len(out) <= 12 and all(len(f) <= bound + 40 for f in out)  # + the envelope
    assert _flatten(out) == _flatten(many)


def test_nothing_to_merge_is_left_as_is() -> None:
    queued = [*_events(1, Encoding.JSON, 1), _end(1, Encoding.JSON)]
    assert coalesce_queued(queued) == queued


class BurstHost:
    """Admits anything; each stream emits EVENTS token events without yielding in between
    (so they are queued together), then completes."""

    def admit(
        self, request: pb.GenerateRequest, metadata: dict[str, str], *, kv_session_bytes: bytes | None = None
    ) -> StreamHandle:
        return StreamHandle(request=request)

    async def run_stream(
        self, handle: StreamHandle, emit: Callable[[pb.GenerateResponse], Awaitable[None]]
    ) -> Outcome:
        for i in range(EVENTS):
            await emit(_token(i))
        return OUTCOME_COMPLETED

    async def call(self, method: str, request: Any, *, owner: object = None) -> Any:
        raise Rejection(pb.ErrorCode.UNSUPPORTED_FEATURE, method)


async def _session(path: str) -> list[str | bytes]:
    """Two streams (JSON and msgpack) on one connection; every frame received until both ended."""
    plane = NorthPlane(BurstHost(), WsConfig())  # type: ignore[arg-type]
    frames: list[str | bytes] = []
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(plane.serve, "127.0.0.1", 0)
            async with open_websocket("127.0.0.1", port, path, use_ssl=False) as ws:
                request = {"model": "m", "prompt": "hi"}
                await ws.send_message(json.dumps({"type": "generate", "stream": 1, "request": request}))
                await ws.send_message(
                    msgspec.msgpack.encode({"type": "generate", "stream": 2, "request": request})
                )
                ends = 0
                while ends < 2:
                    try:
                        frame = await ws.get_message()
                    except ConnectionClosed:
                        break
                    frames.append(frame)
                    ends += sum(isinstance(m, wire.End) for m in _flatten([frame]))
            nursery.cancel_scope.cancel()
    return frames


def _check_order(frames: list[str | bytes]) -> None:
    by_stream: dict[Any, list[Any]] = {1: [], 2: []}
    for frame in frames:
        msg = codec.decode_server_frame(frame)
        for item in msg.items if isinstance(msg, wire.Events) else [msg]:
            by_stream[item.stream].append(item)
            if isinstance(msg, wire.Events):
                assert isinstance(item, wire.Event)
                assert isinstance(frame, str) == (item.stream == 1)  # in its stream's encoding
    for items in by_stream.values():
        assert [i.response.token.text for i in items[:-1]] == [f"t{i}" for i in range(EVENTS)]  # type: ignore[union-attr]
        assert isinstance(items[-1], wire.End) and items[-1].outcome == "completed"


async def test_opted_in_client_gets_events_frames_in_order() -> None:
    frames = await _session("/v1/ws?coalesce=1")
    _check_order(frames)
    merged = [f for f in frames if isinstance(codec.decode_server_frame(f), wire.Events)]
    assert {type(f) for f in merged} == {str, bytes}  # JSON and msgpack both coalesced
    assert len(frames) < 2 * (EVENTS + 1)


@pytest.mark.parametrize("path", ["/v1/ws", "/v1/ws?coalesce=0", "/v1/ws?coalesce=true"])
async def test_other_clients_never_get_events_frames(path: str) -> None:
    frames = await _session(path)
    _check_order(frames)
    assert len(frames) == 2 * (EVENTS + 1)


@pytest.mark.parametrize("encoding", ["json", "msgpack"])
async def test_python_client_unpacks_coalesced_events(encoding: str) -> None:
    plane = NorthPlane(BurstHost(), WsConfig())  # type: ignore[arg-type]
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(plane.serve, "127.0.0.1", 0)
            async with open_sidecar(f"ws://127.0.0.1:{port}", encoding=encoding, coalesce=True) as client:

                async def one(results: list[Any]) -> None:
                    async with client.generate({"model": "m", "prompt": "hi"}) as stream:
                        results.extend([e.response.token.text async for e in stream])  # type: ignore[union-attr]
                    results.append(stream.end.outcome if stream.end else None)

                got: list[list[Any]] = [[], []]
                async with trio.open_nursery() as streams:
                    for results in got:
                        streams.start_soon(one, results)
            nursery.cancel_scope.cancel()
    for results in got:
        assert results == [f"t{i}" for i in range(EVENTS)] + ["completed"]
