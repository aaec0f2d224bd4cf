"""A small spec-conformant engine KV publisher (docs/design/engine-facts.md), independent of the bridge code.

A separate fake from the suite's in-memory ``tests.fake_engine.FakeEngine`` (which serves
``SubscribeKvEvents``) because the engines' ZMQ publishers are another wire: the bridge's
ZMQ source is tested on real sockets and on each engine's own msgpack encoding.

Real ZMQ sockets on 127.0.0.1: an XPUB (a PUB to subscribers; XPUB only so a test can wait
for the bridge's subscription instead of sleeping) and a replay ROUTER. Events are given
in the bridge's *expected output* form (plain dicts, ``"type"`` tagged) and encoded here per
wire style:

- ``vllm-map``: ``[ts, [map events, defaulted fields omitted], rank]``, replay with topic;
- ``vllm-array``: ``[ts, [tagged arrays, trailing defaults omitted], rank]``;
- ``sglang``: map events, cache-salt metadata in the ``lora_name`` slot, replay without
  the topic frame;
- ``sglang-array``: tagged arrays, ``[ts, events]`` batches (no rank), metadata at position 7.

Faults: ``publish(..., send=False)`` buffers a batch without sending it (a live gap),
``restart()`` starts a new publisher process on the same ports (sequence back to 0, empty
buffer), ``buffer_steps`` bounds the replay buffer (lost history), ``replay=False`` serves no
replay socket.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import msgspec
import trio
import zmq

END = b"\xff" * 8

_STORED_ORDER = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
)
_REMOVED_ORDER = ("block_hashes", "medium", "group_idx")
_REQUIRED_STORED = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium")


async def zrecv(sock: zmq.Socket) -> list[bytes]:
    """Receive one message under trio (edge-triggered FD: check EVENTS before waiting)."""
    while not (int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN):
        await trio.lowlevel.wait_readable(sock.FD)
    return sock.recv_multipart(zmq.NOBLOCK)


def _wire_event(ev: dict[str, Any], style: str, negative: bool) -> Any:
    t = ev["type"]
    arrays = style.endswith("array")
    if t == "AllBlocksCleared":
        return [t] if arrays else {"type": t}
    fields = dict(ev)
    fields.pop("type")
    if negative:  # an int64 engine: hashes >= 2**63 travel as negative ints
        fields["block_hashes"] = [
            h - (1 << 64) if isinstance(h, int) and h >= 1 << 63 else h for h in fields["block_hashes"]
        ]
    if t == "BlockStored":
        meta = fields.pop("metadata", None)
        if meta is not None:
            assert style.startswith("sglang"), "metadata is SGLang-only"
            fields["lora_name"] = meta
        order = _STORED_ORDER
        required = 5 if style.startswith("sglang") else 7  # SGLang's older BlockStored has 5 fields
    else:
        order = _REMOVED_ORDER
        required = 1 if style.startswith("sglang") else 2
    if arrays:
        values = [fields.get(k) for k in order]
        while len(values) > required and values[-1] is None:
            values.pop()
        return [t, *values]
    out: dict[str, Any] = {"type": t}
    for i, k in enumerate(order):
        v = fields.get(k)
        # vLLM writes its fields without defaults even when None; SGLang-style omits every None
        if v is not None or (style == "vllm-map" and i < required):
            out[k] = v
    return out


def _as_decoded(wire: Any) -> Any:
    return msgspec.msgpack.decode(msgspec.msgpack.encode(wire))


def encode_wire(
    events: list[dict[str, Any]],
    style: str,
    *,
    rank: int | None = 0,
    ts: float | None = None,
    negative: bool = False,
) -> bytes:
    """One payload in ``style`` for events given in the bridge's output form."""
    wire = [_wire_event(e, style, negative) for e in events]
    ts = time.time() if ts is None else ts
    if style == "sglang-array":
        return msgspec.msgpack.encode([ts, wire])
    return msgspec.msgpack.encode([ts, wire, rank])


class FakeZmqEngine:
    """One DP rank's publisher. Use ``async with FakeZmqEngine(...) as eng`` inside a nursery-owning test."""

    def __init__(
        self,
        nursery: trio.Nursery,
        *,
        rank: int = 0,
        style: str = "vllm-map",
        topic: bytes = b"kv",
        replay: bool = True,
        buffer_steps: int = 1000,
        negative_hashes: bool = False,
    ) -> None:
        self.nursery = nursery
        self.rank = rank
        self.style = style
        self.topic = topic
        self.replay = replay
        self.buffer_steps = buffer_steps
        self.negative_hashes = negative_hashes
        self.ctx = zmq.Context()
        self.pub: zmq.Socket | None = None
        self.port = 0
        self.replay_port = 0
        self.seq = 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.sent: list[tuple[int, list[dict[str, Any]]]] = []  # every published batch (ground truth)
        self.replay_requests: list[int] = []
        self._router_scope: trio.CancelScope | None = None
        self._router_closed: trio.Event | None = None

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    @property
    def replay_endpoint(self) -> str | None:
        return f"tcp://127.0.0.1:{self.replay_port}" if self.replay else None

    async def __aenter__(self) -> FakeZmqEngine:
        await self._open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        # Often left from a cancelled nursery (the test's own): close without waiting on it.
        with trio.CancelScope(shield=True):
            try:
                await self._close()
            finally:
                self.ctx.destroy(linger=0)  # nothing left open, whatever happened

    async def _open(self) -> None:
        self.pub = self.ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(f"tcp://127.0.0.1:{self.port}")
        self.port = int(self.pub.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1])
        if self.replay:
            await self.nursery.start(self._serve_replay)

    async def _close(self) -> None:
        if self._router_scope is not None:
            self._router_scope.cancel()
            self._router_scope = None
            assert self._router_closed is not None
            with trio.fail_after(5):  # the router task closes its socket at once when cancelled
                await self._router_closed.wait()
        if self.pub is not None:
            self.pub.close(linger=0)
            self.pub = None

    async def _serve_replay(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self._router_closed = closed = trio.Event()
        router = self.ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.SNDHWM, 0)
        router.bind(f"tcp://127.0.0.1:{self.replay_port}")
        self.replay_port = int(router.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1])
        try:
            with trio.CancelScope() as scope:
                self._router_scope = scope
                task_status.started()
                while True:
                    ident, _delim, start_b = await zrecv(router)
                    start = int.from_bytes(start_b, "big")
                    self.replay_requests.append(start)
                    with_topic = self.style.startswith("vllm")
                    for seq, payload in list(self.buffer):
                        if seq >= start:
                            body = [self.topic] if with_topic else []
                            router.send_multipart([ident, b"", *body, seq.to_bytes(8, "big"), payload])
                    router.send_multipart([ident, b"", *([b""] if with_topic else []), END, b""])
        finally:
            router.close(linger=0)
            closed.set()

    async def wait_subscribed(self) -> None:
        """Until a subscriber's subscription reached this publisher."""
        assert self.pub is not None
        while True:
            msg = await zrecv(self.pub)
            if msg[0][:1] == b"\x01":
                return

    def encode(self, events: list[dict[str, Any]], ts: float | None = None) -> bytes:
        return encode_wire(events, self.style, rank=self.rank, ts=ts, negative=self.negative_hashes)

    def as_sent(self, *batches: list[dict[str, Any]]) -> list[Any]:
        """The events of ``batches`` as this engine writes them, decoded by a consumer (flattened)."""
        return [_as_decoded(_wire_event(e, self.style, self.negative_hashes)) for b in batches for e in b]

    @property
    def cleared(self) -> Any:
        """``AllBlocksCleared`` in this engine's form."""
        return self.as_sent([{"type": "AllBlocksCleared"}])[0]

    def publish(
        self, events: list[dict[str, Any]], *, send: bool = True, payload: bytes | None = None
    ) -> int:
        """Publish one batch (``send=False``: buffer it only — a batch the subscriber misses)."""
        assert self.pub is not None
        seq = self.seq
        self.seq += 1
        data = self.encode(events) if payload is None else payload
        self.buffer.append((seq, data))
        self.sent.append((seq, events))
        if send:
            self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), data], zmq.NOBLOCK)
        return seq

    async def restart(self) -> None:
        """A new publisher process on the same ports: sequence from 0, empty replay buffer."""
        await self._close()
        self.ctx.term()  # returns once the old sockets are really gone (ports free)
        self.ctx = zmq.Context()
        self.seq = 0
        self.buffer.clear()
        await self._open()
