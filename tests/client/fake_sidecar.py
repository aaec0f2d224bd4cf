"""A scripted fake sidecar (trio-websocket server) for client tests, using the real codec.

The prompt picks the behaviour of a ``generate``:
  ``hello``          three tokens, a finished event with usage, ``end completed``
  ``slow``           one token, then waits for ``cancel`` -> ``end cancelled``
  ``deaf``           one token, then ignores ``cancel`` (never ends)
  ``reject``         ``end rejected`` (ERROR_CODE_DRAINING, retryable)
  ``fail``           one token, an engine error event, ``end failed``
  ``die``            one token, then closes the connection (1011)
  ``prefill``        a ``prefillReady`` event with ``kvSessionBytes``, ``end completed``
  ``protocol``       a ``protocol_error`` message, then ``end completed``
  ``garbage``        an undecodable frame
  ``batch``          (client connected with ``coalesce=1``) the ``hello`` events in one ``events`` frame
Calls: ``describe`` -> ok; ``loadLora`` -> INVALID_ARGUMENT; ``health`` -> never answered.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import trio
from trio_websocket import ConnectionClosed, WebSocketConnection, WebSocketRequest, serve_websocket

from sidecar.north import codec, wire
from sidecar.north.codec import CallCommand, CancelCommand, Encoding, GenerateCommand
from sidecar.openengine import pb

SESSION_BYTES = (
    bytes(pb.KvSessionRef(session_id="sess", dp_rank=1)) + b"\xa2\x06\x03abc"
)  # + unknown field 100


@dataclass
class FakeSidecar:
    port: int = 0
    paths: list[str] = field(default_factory=list)
    #: when set, the handshake needs ``Authorization: Bearer <token>`` (else HTTP 401, as the sidecar)
    token: str | None = None
    commands: list[codec.Command] = field(default_factory=list)
    cancels: list[str | int] = field(default_factory=list)
    cancel_seen: trio.Event = field(default_factory=trio.Event)

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}"

    async def run(self, *, task_status: trio.TaskStatus[FakeSidecar] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            server = await nursery.start(serve_websocket, self._handle, "127.0.0.1", 0, None)
            self.port = server.port
            task_status.started(self)

    async def _handle(self, request: WebSocketRequest) -> None:
        self.paths.append(request.path)
        if (
            self.token is not None
            and (b"authorization", f"Bearer {self.token}".encode()) not in request.headers
        ):
            await request.reject(401)
            return
        coalesce = "coalesce=1" in request.path
        ws = await request.accept()
        cancelled: dict[str | int, trio.Event] = {}
        try:
            async with trio.open_nursery() as nursery:
                while True:
                    frame = await ws.get_message()
                    try:
                        cmd = codec.decode_frame(frame)
                    except codec.ProtocolError as err:
                        await ws.send_message(codec.encode(codec.error_reply(err), Encoding.JSON))
                        continue
                    self.commands.append(cmd)
                    if isinstance(cmd, GenerateCommand):
                        cancelled[cmd.stream] = trio.Event()
                        nursery.start_soon(self._stream, ws, cmd, cancelled[cmd.stream], coalesce)
                    elif isinstance(cmd, CancelCommand):
                        self.cancels.append(cmd.stream)
                        self.cancel_seen.set()
                        if cmd.stream in cancelled:
                            cancelled[cmd.stream].set()
                    elif isinstance(cmd, CallCommand):
                        nursery.start_soon(self._call, ws, cmd)
        except* ConnectionClosed:
            pass

    async def _stream(
        self, ws: WebSocketConnection, cmd: GenerateCommand, cancelled: trio.Event, coalesce: bool
    ) -> None:
        enc, sid = cmd.encoding, cmd.stream
        events = codec.EventEncoder(sid, enc)
        prompt = cmd.request.prompt or ""

        def token(text: str, i: int) -> pb.GenerateResponse:
            return pb.GenerateResponse(
                request_id="r-1",
                token=pb.TokenOutput(
                    output_index=0, tokens=[pb.TokenInfo(token_id=i, token=text)], text=text
                ),
            )

        async def end(outcome: str, error: wire.ErrorBody | None = None) -> None:
            await ws.send_message(codec.encode(codec.end_message(sid, outcome, error), enc))

        if prompt == "batch" and coalesce:
            frames = [events.encode(token(text, i)) for i, text in enumerate(["Hel", "lo", "!"])]
            await ws.send_message(codec.coalesce_events(frames, enc))  # type: ignore[arg-type]
            await end("completed")
        elif prompt == "hello":
            for i, text in enumerate(["Hel", "lo", "!"]):
                await ws.send_message(events.encode(token(text, i)))
            finished = pb.GenerateResponse(
                request_id="r-1",
                finished=pb.GenerationFinished(output_index=0, reason=pb.FinishReason.LENGTH),
                usage=pb.Usage(prompt_tokens=1, completion_tokens=3, total_tokens=4),
            )
            await ws.send_message(events.encode(finished))
            await end("completed")
        elif prompt in ("slow", "deaf"):
            await ws.send_message(events.encode(token("tick", 1)))
            if prompt == "deaf":
                await trio.sleep_forever()
            await cancelled.wait()
            await end("cancelled", codec.error_body(pb.ErrorCode.CANCELLED, "cancelled by client"))
        elif prompt == "reject":
            await end("rejected", codec.error_body(pb.ErrorCode.DRAINING, "draining", retryable=True))
        elif prompt == "fail":
            await ws.send_message(events.encode(token("x", 1)))
            error = pb.EngineError(code=pb.ErrorCode.INTERNAL, message="engine exploded", retryable=True)
            await ws.send_message(events.encode(pb.GenerateResponse(request_id="r-1", error=error)))
            await end("failed", codec.error_body(error.code, error.message, error.retryable))
        elif prompt == "die":
            await ws.send_message(events.encode(token("x", 1)))
            await ws.aclose(1011, "sidecar crashed")
        elif prompt == "prefill":
            session = pb.KvSessionRef.parse(SESSION_BYTES)
            resp = pb.GenerateResponse(request_id="r-1", prefill_ready=pb.PrefillReady(kv_session=session))
            await ws.send_message(events.encode(resp, kv_session_bytes=SESSION_BYTES))
            await end("completed")
        elif prompt == "protocol":
            await ws.send_message(
                codec.encode(wire.ProtocolErrorMessage(message="you did something odd"), enc)
            )
            await end("completed")
        elif prompt == "garbage":
            await ws.send_message("{not json")
        else:
            await end(
                "rejected", codec.error_body(pb.ErrorCode.INVALID_ARGUMENT, f"unknown prompt {prompt!r}")
            )

    async def _call(self, ws: WebSocketConnection, cmd: CallCommand) -> None:
        if cmd.method == "describe":
            reply = codec.result_ok(cmd.call, {"engine": "fake", "models": [{"name": "m"}]})
        elif cmd.method == "health":
            await trio.sleep_forever()
        else:
            reply = codec.result_error(
                cmd.call, codec.error_body(pb.ErrorCode.INVALID_ARGUMENT, "bad adapter")
            )
        await ws.send_message(codec.encode(reply, cmd.encoding))
