"""An independent consumer of the bridge's output, written from the spec (docs/KVBRIDGE.md).

It does not import the bridge: frames ``[topic, seq (8 bytes BE), payload]``, payload a
msgpack array ``[ts, [event...], dp_rank]`` with events as the engine wrote them (maps
tagged by ``"type"``, or tagged arrays), replay over a DEALER
(``[b"", start]`` -> ``[b"", topic, seq, payload]``... ``[b"", b"", 0xFF*8, b""]``). Like a
real KV router it fills gaps in the live stream (including the start it missed while
subscribing) through replay, and records when replay could not give everything.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import trio
import zmq

from tests.kvbridge.fake_zmq_engine import END, zrecv

EVENT_TYPES = {"BlockStored", "BlockRemoved", "AllBlocksCleared"}


@dataclass
class Published:
    seq: int
    ts: float
    events: list[Any]  # maps tagged by "type", or tagged arrays
    rank: int | None
    payload: bytes = b""


def check_hash(h: Any) -> None:
    assert isinstance(h, bytes) or (isinstance(h, int) and -(1 << 63) <= h < 1 << 64), f"bad block hash {h!r}"


def _check_event(ev: Any) -> None:
    if isinstance(ev, list):  # a tagged array: [tag, block_hashes, parent (BlockStored), ...]
        assert ev and ev[0] in EVENT_TYPES, ev
        if ev[0] == "AllBlocksCleared":
            return
        hashes = list(ev[1]) + ([ev[2]] if ev[0] == "BlockStored" and ev[2] is not None else [])
    else:
        assert isinstance(ev, dict) and ev.get("type") in EVENT_TYPES, f"event is not a tagged map: {ev!r}"
        if ev["type"] == "AllBlocksCleared":
            assert ev == {"type": "AllBlocksCleared"}
            return
        hashes = list(ev["block_hashes"]) + (
            [ev["parent_block_hash"]] if ev.get("parent_block_hash") is not None else []
        )
    for h in hashes:
        check_hash(h)


def decode_payload(payload: bytes) -> tuple[float, list[Any], int | None]:
    """Decode and validate one payload per the output spec (events returned as decoded)."""
    raw = msgspec.msgpack.decode(payload)
    assert isinstance(raw, list) and len(raw) >= 3, f"payload is not [ts, events, rank]: {raw!r}"
    ts, events, rank = raw[:3]
    assert isinstance(ts, int | float) and not isinstance(ts, bool)
    assert isinstance(events, list)
    for ev in events:
        _check_event(ev)
    return ts, events, rank


@dataclass
class Consumer:
    """Subscribes to one rank of the bridge. Use inside ``async with``."""

    publish_endpoint: str
    replay_endpoint: str | None
    topic: bytes = b""
    received: list[Published] = field(default_factory=list)
    replays: list[tuple[int, int | None]] = field(default_factory=list)  # (asked, first seq answered)
    lost: list[tuple[int, int]] = field(default_factory=list)  # (expected seq, next seq we could get)

    async def __aenter__(self) -> Consumer:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        self.sub.connect(self.publish_endpoint)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.ctx.destroy(linger=0)

    async def replay(self, start: int) -> list[tuple[bytes, int, bytes]]:
        """Ask the replay endpoint for ``start`` on: ``(topic, seq, payload)`` until the end marker."""
        assert self.replay_endpoint is not None
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        try:
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            out = []
            while True:
                frames = await zrecv(dealer)
                assert len(frames) == 4 and frames[0] == b"", f"replay reply layout {frames!r}"
                _, topic, seq, payload = frames
                assert len(seq) == 8
                if seq == END:
                    assert topic == b"" and payload == b""
                    return out
                out.append((topic, int.from_bytes(seq, "big"), payload))
        finally:
            dealer.close(linger=0)

    def _record(self, seq: int, payload: bytes) -> None:
        ts, events, rank = decode_payload(payload)
        self.received.append(Published(seq, ts, events, rank, payload))

    @property
    def next_seq(self) -> int:
        return self.received[-1].seq + 1 if self.received else 0

    async def _fill(self) -> None:
        want = self.next_seq
        got = await self.replay(want)
        self.replays.append((want, got[0][1] if got else None))
        for t, s, p in got:
            assert t == self.topic
            if s < self.next_seq:
                continue
            if s > self.next_seq:
                self.lost.append((self.next_seq, s))
            self._record(s, p)

    async def collect(
        self, until: Callable[[list[Published]], bool], *, idle: float = 0.1
    ) -> list[Published]:
        """Read live messages until ``until(received)`` holds, filling gaps by replay.

        Like a router that joins late, it also asks for replay when the live stream stays
        quiet for ``idle`` seconds (what it missed while its subscription propagated).
        """
        while not until(self.received):
            frames = None
            with trio.move_on_after(idle if self.replay_endpoint else math.inf):
                frames = await zrecv(self.sub)
            if frames is None:
                await self._fill()
                continue
            topic, seq_b, payload = frames
            assert topic.startswith(self.topic) and len(seq_b) == 8
            seq = int.from_bytes(seq_b, "big")
            if seq < self.next_seq:
                continue
            if seq > self.next_seq and self.replay_endpoint:
                await self._fill()
                if seq < self.next_seq:
                    continue
            if seq > self.next_seq:
                self.lost.append((self.next_seq, seq))
            self._record(seq, payload)
        return self.received

    async def collect_events(self, n: int) -> list[Any]:
        """Until ``n`` events arrived; returns all events in order (seqs checked contiguous)."""
        await self.collect(lambda rs: sum(len(r.events) for r in rs) >= n)
        seqs = [r.seq for r in self.received]
        assert seqs == list(range(len(seqs))), f"output seqs not contiguous from 0: {seqs}"
        assert not self.lost, f"consumer lost history: {self.lost}"
        return [e for r in self.received for e in r.events]
