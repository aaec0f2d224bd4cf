"""Stream limits and id misuse on a real sidecar: thousands of streams on one connection hit
the per-connection limit (typed, retryable ``OVERLOADED``), the sidecar-wide limit does the
same across connections, a duplicate open stream id (a ``protocol_error`` naming it) and cancels
of unknown streams are answered as documented, and nothing leaks on the engine."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import trio

from sidecar.north import codec, wire
from tests.e2e.harness import eventually, mock_engine, sidecar, wait_engine_idle
from tests.fuzz.rawws import Closed, RawWs
from tests.reliability.helpers import scrape, stall_request

pytestmark = pytest.mark.subprocess

PER_CONNECTION = 100
SIDECAR_WIDE = 150
FLOOD = 2000


class Client:
    """A raw connection whose reader task keeps every ``end`` and counts events per stream
    (it reads while we flood: a client that does not read is a stuck client, and is dropped)."""

    def __init__(self, ws: RawWs) -> None:
        self.ws = ws
        self.ends: dict[Any, list[wire.End]] = {}
        self.events: dict[Any, int] = {}
        self.other: list[Any] = []
        self.n = 0
        self._changed = trio.Event()

    async def reader(self) -> None:
        while True:
            try:
                raw = await self.ws.next()
            except (Closed, trio.ClosedResourceError):
                return
            msg = codec.decode_server_frame(raw)
            if isinstance(msg, wire.End):
                self.ends.setdefault(msg.stream, []).append(msg)
            elif isinstance(msg, wire.Event):
                self.events[msg.stream] = self.events.get(msg.stream, 0) + 1
            else:
                self.other.append(msg)
            self._changed.set()
            self._changed = trio.Event()

    async def send(self, msg: dict[str, Any]) -> None:
        await self.ws.send_text(json.dumps(msg))

    async def read_until(self, done: Any) -> None:
        while not done():
            await self._changed.wait()

    async def sync(self) -> None:
        """Round-trip a ``call``: every answer to earlier frames that is due at once has come."""
        self.n += 1
        await self.send({"type": "call", "call": f"sync-{self.n}", "method": "health"})
        await self.read_until(
            lambda: any(isinstance(m, wire.Result) and m.call == f"sync-{self.n}" for m in self.other)
        )
        self.other = [
            m for m in self.other if not (isinstance(m, wire.Result) and str(m.call).startswith("sync-"))
        ]


def generate(stream: Any, rid: str) -> dict[str, Any]:
    return {
        "type": "generate",
        "stream": stream,
        "request": stall_request(max_tokens=50, stall_after=1, requestId=rid),
    }


async def test_limits_duplicates_and_unknown_cancels(aio_loop: Any, tmp_path: Path) -> None:
    with trio.fail_after(60):
        async with (
            mock_engine(tmp_path, "--flavor", "vllm", "--max-running", "400", "--max-queue", "400") as engine,
            sidecar(
                engine.address,
                "--max-streams-per-connection",
                str(PER_CONNECTION),
                "--max-streams",
                str(SIDECAR_WIDE),
                "--peer-stream-share",  # both connections are one peer (127.0.0.1)
                "1",
            ) as sc,
            trio.open_nursery() as nursery,
        ):
            a = Client(await RawWs.connect(sc.ws))
            nursery.start_soon(a.reader)
            # thousands of streams on one connection: the first PER_CONNECTION are admitted
            # (each stalls after one token, so they stay open), every other one is refused
            for i in range(FLOOD):
                await a.send(generate(i, f"a-{i}"))
            await a.read_until(
                lambda: len(a.ends) == FLOOD - PER_CONNECTION and len(a.events) == PER_CONNECTION
            )
            assert sorted(a.events) == list(range(PER_CONNECTION))
            for i in range(PER_CONNECTION, FLOOD):
                (end,) = a.ends[i]
                assert end.outcome == "rejected" and end.error is not None
                assert end.error.code == "ERROR_CODE_OVERLOADED" and end.error.retryable, end
                assert f"at most {PER_CONNECTION} open streams per connection" in end.error.message
            # a duplicate of an open stream id: a protocol_error naming it, the open stream untouched
            await a.send(generate(5, "a-dup"))
            # cancels of streams never opened (or already refused): nothing happens
            for unknown in (FLOOD + 1, "nope", PER_CONNECTION + 3, 0.5, -1):
                await a.send({"type": "cancel", "stream": unknown})
            await a.sync()
            assert 5 not in a.ends
            dup, *others = a.other
            assert isinstance(dup, wire.ProtocolErrorMessage) and dup.stream == 5
            assert "already open" in dup.message
            assert [(type(m).__name__, m.stream) for m in others] == [
                ("ProtocolErrorMessage", None),
                ("ProtocolErrorMessage", None),
            ]  # 0.5, -1
            # cancel twice: one end
            await a.send({"type": "cancel", "stream": 6})
            await a.send({"type": "cancel", "stream": 6})
            await a.read_until(lambda: 6 in a.ends)
            await a.sync()
            assert [e.outcome for e in a.ends[6]] == ["cancelled"]

            # a second connection runs into the sidecar-wide limit
            b = Client(await RawWs.connect(sc.ws))
            nursery.start_soon(b.reader)
            for i in range(60):
                await b.send(generate(i, f"b-{i}"))
            room = SIDECAR_WIDE - (PER_CONNECTION - 1)  # stream 6 of A has ended
            await b.read_until(lambda: len(b.ends) == 60 - room and len(b.events) == room)
            for (end,) in b.ends.values():
                assert end.outcome == "rejected" and end.error is not None
                assert end.error.code == "ERROR_CODE_OVERLOADED" and end.error.retryable
                assert f"limit of {SIDECAR_WIDE} streams" in end.error.message
            m = await scrape(sc.http)
            assert m.value("openengine_sidecar_active_streams") == SIDECAR_WIDE

            # A vanishes: its streams are cancelled and aborted; B is unaffected and then cancels
            await a.ws.stream.aclose()

            async def a_gone() -> bool:
                return (await scrape(sc.http)).value("openengine_sidecar_active_streams") == room

            await eventually(a_gone, 10)  # another process's gauge
            assert all(n == 1 for n in b.events.values())  # still stalled, still open
            for i in sorted(b.events):
                await b.send({"type": "cancel", "stream": i})
            await b.read_until(lambda: len(b.ends) == 60)
            assert sorted(e[0].outcome for i, e in b.ends.items() if i in b.events) == ["cancelled"] * room
            await b.ws.aclose()

            counters = await wait_engine_idle(engine.address, timeout=20)
            admitted = PER_CONNECTION + room
            assert counters["requests_accepted"] == admitted
            assert counters["requests_leaked"] == 0 and counters["orphans_expired"] == 0
            by_id = counters["aborts_received_by_id"]
            assert len(by_id) == admitted and set(by_id.values()) == {1}
            m = await scrape(sc.http)
            overloaded = (FLOOD - PER_CONNECTION) + (60 - room)
            assert (
                m.value("openengine_sidecar_streams_total", outcome="rejected", code="ERROR_CODE_OVERLOADED")
                == overloaded
            )
            assert m.value("openengine_sidecar_active_streams") == 0
            nursery.cancel_scope.cancel()
