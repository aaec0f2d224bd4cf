"""Fuzz a real sidecar (``openengine-sidecar run`` before a simulated engine) with a few hundred
seeded random frames, then prove it still serves and the engine holds nothing.

Every frame's expected answer is predicted in-process by the same codec the server runs
(``decode_frame``): an undecodable frame closes the connection with 1007, an oversized one
with 1009, a WebSocket framing error with 1002; a frame that decodes but is invalid gets its
typed ``protocol_error`` / ``end rejected`` / failed ``result`` before the next frame is read;
a ``generate`` gets exactly one ``end`` (cancelled by us at the latest); a ``call`` gets one
``result``; a ``generate`` / ``call`` reusing the id of a stream / call still open gets a
``protocol_error`` naming it instead (or, when that one ended meanwhile, its normal answer).
A sentinel ``call`` after each frame orders the answers.
"""

from __future__ import annotations

import collections
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import trio

from sidecar.client.sidecar_client import open_sidecar
from sidecar.north import codec, wire
from tests.e2e.harness import generate_request, mock_engine, sidecar, wait_engine_idle
from tests.fuzz.mutate import OP_BINARY, OP_CLOSE, OP_PING, OP_TEXT, Frame, FrameFuzzer, ws_frame
from tests.fuzz.rawws import Closed, RawWs
from tests.reliability.helpers import scrape

pytestmark = pytest.mark.subprocess

MAX_MESSAGE = 65536
FRAMES = 600
SEED = 20261129


@dataclass
class Expect:
    close: set[int] = field(default_factory=set)
    reply: Any = None  # the wire message an invalid frame must get
    generate: Any = None  # stream id of a decoded generate (one end follows, some time)
    call: Any = None  # call id of a decoded call (one result follows)


def expect(frame: Frame) -> Expect:
    if frame.raw is not None:
        return Expect(close={1002})
    if len(frame.payload) > MAX_MESSAGE:
        return Expect(close={1009})
    if frame.opcode == OP_TEXT:
        try:
            frame.payload.decode("utf-8")
        except UnicodeDecodeError:
            return Expect(close={1007})
    try:
        cmd = codec.decode_frame(frame.message)
    except codec.FrameDecodeError:
        return Expect(close={1007})
    except codec.ProtocolError as err:
        return Expect(reply=codec.error_reply(err))
    if isinstance(cmd, codec.GenerateCommand):
        return Expect(generate=cmd.stream)
    if isinstance(cmd, codec.CallCommand):
        return Expect(call=cmd.call)
    return Expect()


def _key(msg: Any) -> tuple[Any, ...]:
    if isinstance(msg, wire.End):
        return ("end", msg.stream, msg.outcome, msg.error.code if msg.error else None)
    if isinstance(msg, wire.Result):
        return ("result", msg.call, msg.ok, msg.error.code if msg.error else None)
    if isinstance(msg, wire.ProtocolErrorMessage):
        return ("protocol_error", msg.stream, msg.call)
    return (type(msg).__name__,)


@dataclass
class Tally:
    frames: collections.Counter[str] = field(default_factory=collections.Counter)
    answers: collections.Counter[str] = field(default_factory=collections.Counter)
    generates: int = 0
    ends: int = 0
    dropped: int = 0  # streams still open when the server closed the connection
    violations: list[str] = field(default_factory=list)


class Conn:
    """One fuzzed connection and the answers it still owes."""

    def __init__(self, ws: RawWs, tally: Tally) -> None:
        self.ws = ws
        self.tally = tally
        self.streams: collections.Counter[Any] = collections.Counter()  # stream id -> ends owed
        self.calls: collections.Counter[Any] = collections.Counter()
        self.sync = 0
        self.awaited: tuple[Any, ...] | None = None  # key of the reply the last frame must get
        #: The last frame reused this open id (("stream", id) / ("call", id)): the sidecar may
        #: refuse it with a protocol_error naming the id; ``reused_counted``: its generate / call
        #: was counted as owing an answer, to be undone then.
        self.reused: tuple[str, Any] | None = None
        self.reused_counted = False

    def _take(self, raw: str | bytes) -> Any:
        msg = codec.decode_server_frame(raw)  # every answer is a well-formed server message
        t = self.tally
        if isinstance(msg, wire.ProtocolErrorMessage) and (msg.stream is not None or msg.call is not None):
            named = ("stream", msg.stream) if msg.stream is not None else ("call", msg.call)
            if self.reused is None or named != self.reused:
                t.violations.append(f"{msg} names an id the last frame did not reuse ({self.reused})")
                return None
            if self.reused_counted:  # refused: that generate / call owes nothing
                if named[0] == "stream":
                    self.streams[named[1]] -= 1
                    t.generates -= 1
                else:
                    self.calls[named[1]] -= 1
            self.reused, self.awaited = None, None
            t.answers["protocol_error id in use"] += 1
            return None
        if self.awaited is not None and _key(msg) == self.awaited:
            self.awaited = None  # the reply to the invalid frame (its id may also be open: PROTOCOL.md)
            if isinstance(msg, wire.End):
                t.answers[f"end {msg.outcome}"] += 1
            elif isinstance(msg, wire.Result):
                t.answers[f"result {msg.error.code if msg.error else 'ok'}"] += 1
            else:
                t.answers["protocol_error"] += 1
            return msg
        if isinstance(msg, wire.Event):
            if self.streams[msg.stream] <= 0:
                t.violations.append(f"event for stream {msg.stream!r} with no open generate")
        elif isinstance(msg, wire.End):
            t.answers[f"end {msg.outcome}"] += 1
            if self.streams[msg.stream] <= 0:
                return msg  # may be the reply to an invalid generate: checked by the caller
            self.streams[msg.stream] -= 1
            t.ends += 1
            return None
        elif isinstance(msg, wire.Result):
            if isinstance(msg.call, str) and msg.call.startswith("sync-"):
                return msg
            t.answers[f"result {'ok' if msg.ok else msg.error.code if msg.error else '?'}"] += 1
            if self.calls[msg.call] > 0:
                self.calls[msg.call] -= 1
                return None
        elif isinstance(msg, wire.ProtocolErrorMessage):
            t.answers["protocol_error"] += 1
        return msg

    async def fuzz(self, frame: Frame) -> bool:
        """Send one frame and check its immediate answer; False once the server closed."""
        want = expect(frame)
        self.tally.frames[frame.kind] += 1
        await self.ws.send(frame)
        if want.generate is not None:
            self.streams[want.generate] += 1
            self.tally.generates += 1
        if want.call is not None:
            self.calls[want.call] += 1
        self.awaited = _key(want.reply) if want.reply is not None else None
        self.reused, self.reused_counted = None, False
        stream = want.generate if want.generate is not None else getattr(want.reply, "stream", None)
        call = want.call if want.call is not None else getattr(want.reply, "call", None)
        if stream is not None and self.streams[stream] - (want.generate is not None) > 0:
            self.reused, self.reused_counted = ("stream", stream), want.generate is not None
        elif call is not None and self.calls[call] - (want.call is not None) > 0:
            self.reused, self.reused_counted = ("call", call), want.call is not None
        self.sync += 1
        sentinel = f"sync-{self.sync}"
        await self.ws.send_text(json.dumps({"type": "call", "call": sentinel, "method": "health"}))
        got: list[Any] = []
        try:
            while True:
                msg = self._take(await self.ws.next())
                if isinstance(msg, wire.Result) and msg.call == sentinel:
                    break
                if msg is not None and not isinstance(msg, wire.Event):
                    got.append(msg)
        except Closed as closed:
            self.tally.answers[f"close {closed.code}"] += 1
            self.tally.dropped += sum(v for v in self.streams.values() if v > 0)
            if closed.code not in want.close:
                self.tally.violations.append(
                    f"{frame.kind} frame {frame.payload[:80]!r}: close {closed.code}, wanted {want}"
                )
            return False
        if want.close:
            self.tally.violations.append(
                f"{frame.kind} frame {frame.payload[:80]!r}: not closed, wanted {want.close}"
            )
        if self.awaited is not None:
            self.tally.violations.append(
                f"{frame.kind} frame {frame.payload[:80]!r}: got {got}, wanted {want.reply}"
            )
        stray = [m for m in got if want.reply is None or _key(m) != _key(want.reply)]
        stray = [m for m in stray if not (isinstance(m, wire.Result) and self.calls[m.call] >= 0)]
        for m in stray:
            if isinstance(m, wire.End | wire.ProtocolErrorMessage):
                self.tally.violations.append(
                    f"unexpected {m} after {frame.kind} frame {frame.payload[:80]!r}"
                )
        return True

    async def settle(self) -> None:
        """Cancel what is still open and collect every ``end`` and ``result`` still owed."""
        for stream, owed in self.streams.items():
            if owed > 0:
                await self.ws.send_text(json.dumps({"type": "cancel", "stream": stream}))
        with trio.move_on_after(15) as scope:
            while any(v > 0 for v in self.streams.values()) or any(v > 0 for v in self.calls.values()):
                self._take(await self.ws.next())
        if scope.cancelled_caught:
            still = {k: v for k, v in self.streams.items() if v > 0}
            self.tally.violations.append(
                f"no end for streams {still} / results {dict(+self.calls)} within 15s"
            )


async def test_random_frames_against_a_real_sidecar(aio_loop: Any, tmp_path: Path) -> None:
    fuzzer = FrameFuzzer(SEED, max_message_size=MAX_MESSAGE)
    tally = Tally()
    with trio.fail_after(80):
        async with (
            mock_engine(tmp_path, "--flavor", "vllm", "--token-delay-ms", "2") as engine,
            sidecar(
                engine.address,
                "--max-message-size",
                str(MAX_MESSAGE),
                "--max-streams-per-connection",
                "6",
            ) as sc,
        ):
            sent = 0
            while sent < FRAMES:
                conn = Conn(await RawWs.connect(sc.ws), tally)
                open_ = True
                for _ in range(fuzzer.rng.randint(10, 60)):
                    if sent >= FRAMES:
                        break
                    sent += 1
                    if not await conn.fuzz(fuzzer.frame()):
                        open_ = False
                        break
                if open_:
                    await conn.settle()
                await conn.ws.aclose()
            print(f"frames by kind: {dict(tally.frames)}")
            print(
                f"answers: {dict(tally.answers)}; generates {tally.generates}: {tally.ends} ended, "
                f"{tally.dropped} open when the server closed the connection"
            )
            assert tally.violations == [], "\n".join(tally.violations[:20])
            # the sidecar is unharmed: nothing in flight, nothing leaked, still serving
            counters = await wait_engine_idle(engine.address, timeout=20)
            assert counters["requests_leaked"] == 0 and counters["orphans_expired"] == 0
            async with open_sidecar(sc.ws) as client, client.generate(generate_request(max_tokens=4)) as s:
                assert len([e async for e in s]) == 5
            assert s.end is not None and s.end.outcome == "completed"
            m = await scrape(sc.http)
            assert m.value("openengine_sidecar_active_streams") == 0
            assert m.value("openengine_sidecar_connections") == 0
            assert m.value("openengine_sidecar_protocol_errors_total") > 0
            assert sc.proc.process.returncode is None
            bad = [line for line in sc.proc.lines if "Traceback" in line or " ERROR " in line]
            assert bad == [], "\n".join(sc.proc.lines[-40:])
    # enough of each kind really happened
    assert tally.answers["close 1007"] >= 3 and tally.answers["close 1009"] >= 1
    assert tally.frames["framing"] >= 1 and tally.frames["invalid-utf8"] >= 1
    assert tally.answers["protocol_error"] >= 10 and tally.answers["end rejected"] >= 10
    # every decoded generate got its one end, or was open when the server closed the connection
    # (how many complete first depends on timing: the closing frames come every few frames)
    assert tally.ends + tally.dropped == tally.generates and tally.ends >= 20


#: One frame of each WebSocket-level fault (found by wsproto, below the north protocol) and the
#: close code RFC 6455 / docs/PROTOCOL.md give it.
WS_FAULTS = [
    ("invalid UTF-8 text", ws_frame(OP_TEXT, b'{"type":"cancel","stream":"\xff\xfe"}'), 1007),
    (
        "invalid UTF-8 in a continuation",
        ws_frame(OP_TEXT, b'{"type":', fin=False) + ws_frame(0x0, b'"\xc3\x28"}'),
        1007,
    ),
    ("reserved opcode", ws_frame(0x3, b"reserved opcode"), 1002),
    ("RSV bit", ws_frame(OP_TEXT, b"{}", rsv=4), 1002),
    ("unmasked frame", ws_frame(OP_TEXT, b"{}", masked=False), 1002),
    ("fragmented ping", ws_frame(OP_PING, b"p", fin=False), 1002),
    ("oversized ping", ws_frame(OP_PING, b"x" * 130), 1002),
    ("continuation of nothing", ws_frame(0x0, b"orphan"), 1002),
    ("close frame with a reserved code", ws_frame(OP_CLOSE, (999).to_bytes(2, "big")), 1002),
    ("oversized message", ws_frame(OP_BINARY, b"\x90" * (MAX_MESSAGE + 1)), 1009),
    (
        "oversized message in fragments",
        ws_frame(OP_TEXT, b"[" * (MAX_MESSAGE // 2), fin=False)
        + ws_frame(0x0, b"[" * (MAX_MESSAGE // 2 + 2)),
        1009,
    ),
]


async def test_each_websocket_fault_gets_its_close_frame_and_the_sidecar_keeps_serving(
    aio_loop: Any, tmp_path: Path
) -> None:
    """Per fault: a connection with a stream in flight sends the fault and gets the close frame
    with its code (not a TCP drop, 1006); its stream is aborted on the engine; a connection
    opened before the faults completes a generate after each one."""
    with trio.fail_after(60):
        async with (
            mock_engine(tmp_path, "--flavor", "vllm", "--token-delay-ms", "5") as engine,
            sidecar(engine.address, "--max-message-size", str(MAX_MESSAGE)) as sc,
            open_sidecar(sc.ws) as bystander,
        ):
            got: dict[str, int] = {}
            for i, (name, raw, _code) in enumerate(WS_FAULTS):
                ws = await RawWs.connect(sc.ws)
                request = generate_request(max_tokens=2000, requestId=f"fault-{i}")
                await ws.send_text(json.dumps({"type": "generate", "stream": 1, "request": request}))
                first = codec.decode_server_frame(await ws.next())
                assert isinstance(first, wire.Event), first  # the stream is running
                await ws.send(Frame(OP_TEXT, b"", name, raw=raw))
                try:
                    while True:
                        await ws.next()
                except Closed as closed:
                    got[name] = closed.code
                await ws.aclose()
                async with bystander.generate(generate_request(max_tokens=3)) as s:
                    assert len([e async for e in s]) == 4
                assert s.end is not None and s.end.outcome == "completed", (name, s.end)
            assert got == {name: code for name, _, code in WS_FAULTS}
            counters = await wait_engine_idle(engine.address, timeout=20)
            aborted = counters["aborts_received_by_id"]
            assert {f"fault-{i}": aborted.get(f"fault-{i}") for i in range(len(WS_FAULTS))} == {
                f"fault-{i}": 1 for i in range(len(WS_FAULTS))
            }
            assert counters["requests_leaked"] == 0 and counters["orphans_expired"] == 0
            m = await scrape(sc.http)
            assert m.value("openengine_sidecar_connections") == 1  # the bystander
            assert sc.proc.process.returncode is None
            bad = [line for line in sc.proc.lines if "Traceback" in line or " ERROR " in line]
            assert bad == [], "\n".join(sc.proc.lines[-40:])
