"""Replay protocol pieces (I/O-free): the bounded buffer and the frame layouts.

Protocol (docs/KVBRIDGE.md, docs/design/engine-facts.md "KV events over ZMQ"): a subscriber's
DEALER sends ``[b"", start_seq (8 bytes big-endian)]`` to the ROUTER; the answer is
``[b"", topic, seq, payload]`` for every held batch with ``seq >= start`` — or from the
oldest held batch when ``start`` is older than the buffer — then the end marker
``[b"", b"", 0xFF*8, b""]``. Engines' replay sockets send the same without the topic frame
(SGLang) or with it (vLLM); :func:`parse_upstream_reply` reads both.
"""

from __future__ import annotations

from collections import deque

from sidecar.kvbridge.errors import KvDecodeError

END_SEQ = b"\xff" * 8
"""The end-of-replay sequence frame (-1 as a signed 64-bit big-endian int)."""


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


class ReplayBuffer:
    """The last ``steps`` published batches as ``(seq, payload)``, contiguous in ``seq``."""

    __slots__ = ("_items", "steps")

    def __init__(self, steps: int) -> None:
        if steps < 1:
            raise ValueError("replay buffer needs at least one step")
        self.steps = steps
        self._items: deque[tuple[int, bytes]] = deque(maxlen=steps)

    def __len__(self) -> int:
        return len(self._items)

    @property
    def oldest(self) -> int | None:
        return self._items[0][0] if self._items else None

    @property
    def newest(self) -> int | None:
        return self._items[-1][0] if self._items else None

    def append(self, seq: int, payload: bytes) -> None:
        if self._items and seq != self._items[-1][0] + 1:
            raise ValueError(f"replay buffer got seq {seq} after {self._items[-1][0]}")
        self._items.append((seq, payload))

    def get(self, seq: int) -> bytes | None:
        """The payload of batch ``seq``, or ``None`` when it is not (or no longer) held."""
        items = self._items
        if not items:
            return None
        i = seq - items[0][0]
        return items[i][1] if 0 <= i < len(items) else None


def parse_replay_request(frames: list[bytes]) -> tuple[list[bytes], int] | None:
    """A ROUTER-side request: ``(reply envelope, start)``, or ``None`` when malformed.

    Accepts ``[identity, b"", start]`` (DEALER/REQ with delimiter) and ``[identity, start]``;
    the envelope (identity, plus the delimiter when the request had one) prefixes each reply.
    """
    if len(frames) == 3 and frames[1] == b"":
        envelope, start = frames[:2], frames[2]
    elif len(frames) == 2:
        envelope, start = frames[:1], frames[1]
    else:
        return None
    if len(start) != 8:
        return None
    return envelope, int.from_bytes(start, "big")


def parse_upstream_reply(frames: list[bytes]) -> tuple[int, bytes] | None:
    """One message an engine's replay ROUTER sent to our DEALER.

    ``(seq, payload)`` for a batch, ``None`` for the end marker. Layouts:
    ``[b"", topic, seq, payload]``, ``[b"", seq, payload]`` (and both without the leading
    delimiter). Raises :class:`KvDecodeError` for anything else.
    """
    body = frames[1:] if len(frames) >= 3 and frames[0] == b"" else frames
    if len(body) == 3:
        seq, payload = body[1], body[2]
    elif len(body) == 2:
        seq, payload = body[0], body[1]
    else:
        raise KvDecodeError(f"replay reply with {len(frames)} frames")
    if len(seq) != 8:
        raise KvDecodeError(f"replay reply sequence frame has {len(seq)} bytes")
    if seq == END_SEQ:
        return None
    return int.from_bytes(seq, "big"), payload
