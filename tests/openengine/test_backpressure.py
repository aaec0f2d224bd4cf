"""HTTP/2 flow control as backpressure: a caller that stops reading stalls the engine's stream.

The engine (a real grpclib server on loopback) sends 1 KiB messages; the caller reads one and
stops. What the engine managed to send is what the client side buffers for it: at most one
stream window (64 KiB) plus a message. (Acknowledging bytes as they arrive while the caller
has less than a window queued would let a non-reading caller hold two windows — enough for a
real vLLM engine to finish a request the client never read.) Another stream on the same
connection keeps flowing meanwhile, and the stalled one resumes whole when read.
"""

from __future__ import annotations

import asyncio
from typing import Any

import trio
import trio_asyncio

from sidecar.openengine import pb
from sidecar.openengine.client import open_engine_client
from tests.openengine.fake_grpc_engine import RunningServer, tokens

MESSAGES = 600  # 600 KiB: far beyond what any buffer on the way may hold
TEXT = "x" * 1000
WINDOW = 64 * 1024


def req(request_id: str) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=request_id, model="m", prompt="hi")


async def test_a_caller_that_stops_reading_stalls_only_its_own_stream(server: RunningServer) -> None:
    pulled: list[int] = []
    stalled = asyncio.Event()

    def script(request: pb.GenerateRequest, _md: dict[str, str]) -> Any:
        if request.request_id != "big":
            yield from tokens(request.request_id, 3)
            return
        for i in range(MESSAGES):
            pulled.append(i)  # message i is asked for: the ones before it were sent
            yield pb.GenerateResponse(
                request_id="big",
                token=pb.TokenOutput(output_index=0, text=TEXT, tokens=[pb.TokenInfo(token_id=i)]),
            )
        stalled.set()  # never, while the caller does not read (checked below)
        yield pb.GenerateResponse(
            request_id="big",
            finished=pb.GenerationFinished(output_index=0, reason=pb.FinishReason.LENGTH),
            usage=pb.Usage(prompt_tokens=1, completion_tokens=MESSAGES, total_tokens=MESSAGES + 1),
        )

    server.engine.streams["Generate"] = script
    with trio.fail_after(30):
        async with open_engine_client(server.address) as client:
            async with client.generate(req("big")) as stream:
                first = await stream.__anext__()
                assert first.token is not None and first.token.tokens[0].token_id == 0
                # The engine's sends stop once the windows are full; wait until they have.
                previous = -1
                while len(pulled) != previous:
                    previous = len(pulled)
                    with trio.move_on_after(0.5):
                        await trio_asyncio.aio_as_trio(stalled.wait)()
                sent = len(pulled) - 1
                wire_size = len(bytes(first)) + 5
                assert not stalled.is_set()
                allowed = WINDOW // wire_size + 2
                assert sent <= allowed, (sent, wire_size, allowed)

                # Another stream on the same connection is not held back.
                async with client.generate(req("small")) as other:
                    assert len([e async for e in other]) == 4

                rest = [event async for event in stream]
            ids = [e.token.tokens[0].token_id for e in rest if e.token is not None]
            assert ids == list(range(1, MESSAGES))
            assert rest[-1].finished is not None
