"""A seeded mutation fuzzer of north-protocol frames (no hypothesis: cheap, reproducible from a
seed, usable against a live sidecar and from ``python -m tests.fuzz.harness``).

``FrameFuzzer(seed).frame()`` returns a :class:`Frame`: a WebSocket opcode and payload. Most
are valid messages (generate / cancel / call) with structural mutations (a node replaced by a
huge, negative or ill-typed value, deep nesting, unknown keys, keys deleted, ids at and past
their limits; along the size dimensions of issue 15: integers as decimal strings of 21 to
20,000 digits, strings a client controls — request ids, model names, ``type`` and ``method``
values — from 257 characters to 64 KiB with control characters in them, nesting past the
decoder's recursion), encoded as JSON text or msgpack binary; some are corrupted at the byte level;
some are raw: invalid UTF-8 text, random bytes, oversized messages, WebSocket framing errors.
"""

from __future__ import annotations

import copy
import json
import random
from dataclasses import dataclass
from typing import Any

import msgspec

OP_TEXT, OP_BINARY, OP_CLOSE, OP_PING = 0x1, 0x2, 0x8, 0x9

MODEL = "Qwen/Qwen3-0.6B"
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@dataclass
class Frame:
    """One WebSocket message to send: ``kind`` names how it was made (for reports)."""

    opcode: int
    payload: bytes
    kind: str
    raw: bytes | None = None  # complete wire bytes (framing faults) instead of opcode + payload

    @property
    def message(self) -> str | bytes:
        """What the server's decoder receives (text frames as ``str``)."""
        if self.opcode == OP_TEXT:
            return self.payload.decode("utf-8", "surrogateescape")
        return self.payload


def ws_frame(opcode: int, payload: bytes, *, fin: bool = True, rsv: int = 0, masked: bool = True) -> bytes:
    """A client WebSocket frame (RFC 6455 §5.2). The mask key is zero, so the payload goes as is."""
    head = bytes([(0x80 if fin else 0) | (rsv << 4) | opcode])
    n = len(payload)
    bit = 0x80 if masked else 0
    if n < 126:
        head += bytes([bit | n])
    elif n < 1 << 16:
        head += bytes([bit | 126]) + n.to_bytes(2, "big")
    else:
        head += bytes([bit | 127]) + n.to_bytes(8, "big")
    return head + (b"\x00\x00\x00\x00" if masked else b"") + payload


class FrameFuzzer:
    """Seeded frame generator (see module doc). ``max_message_size`` is the server's limit."""

    def __init__(self, seed: int | str, *, max_message_size: int = 65536, max_tokens: int = 8) -> None:
        self.rng = random.Random(seed)
        self.max_message_size = max_message_size
        self.max_tokens = max_tokens
        self.stream_ids: list[Any] = [0, 1, 2, 3, "a", "b", 2**53 - 1, "x" * 128]

    # -- valid seeds ---------------------------------------------------------------------------

    def _stream(self) -> Any:
        return self.rng.choice(self.stream_ids)

    def seed_message(self) -> dict[str, Any]:
        r = self.rng
        kind = r.choices(["generate", "cancel", "call"], weights=[6, 2, 2])[0]
        if kind == "cancel":
            return {"type": "cancel", "stream": self._stream()}
        if kind == "call":
            method = r.choice(["describe", "health", "load", "listLoras", "unloadLora"])
            msg: dict[str, Any] = {"type": "call", "call": r.randint(0, 50), "method": method}
            if method == "unloadLora":
                msg["params"] = {"loraName": "nope"}
            elif method == "load" and r.random() < 0.5:
                msg["params"] = {"includePerRank": True}
            return msg
        request: dict[str, Any] = {
            "model": MODEL,
            "prompt": r.choice(["hi", "Hello world", "é" * 5, ""]),
            "stopping": {"maxTokens": r.randint(1, self.max_tokens), "ignoreEos": True},
        }
        if r.random() < 0.3:
            request["sampling"] = {
                "temperature": r.choice([0, 0.7, 1.5]),
                "seed": str(r.randint(0, 2**64 - 1)),
            }
        if r.random() < 0.2:
            request["response"] = {
                "returnOutputLogprobs": True,
                "outputCandidates": {"topN": r.randint(0, 25)},
            }
        if r.random() < 0.1:
            request["tokenIds"] = {"ids": [r.randint(0, 1000) for _ in range(r.randint(0, 4))]}
            del request["prompt"]
        msg = {"type": "generate", "stream": self._stream(), "request": request}
        if r.random() < 0.3:
            msg["metadata"] = r.choice(
                [
                    {"openengine-routing-key": "user-1"},
                    {"traceparent": TRACEPARENT},
                    {"openengine-target-dp-rank": r.choice(["0", "1", "-1", "x", "4294967296"])},
                    {"openengine-priority": r.choice(["5", "-2147483649"])},
                    {"x-app": "1", "Grpc-Timeout": "1S"},
                ]
            )
        return msg

    # -- structural mutations ----------------------------------------------------------------------

    def _junk(self) -> Any:
        r = self.rng
        return r.choice(
            [
                None,
                True,
                -1,
                0,
                2**31,
                2**32,
                2**53,
                2**63,
                2**64,
                -(2**63) - 1,
                10**40,
                1.5,
                -0.0,
                1e308,
                "",
                "x" * r.randint(1, 300),
                "NaN",
                "-Infinity",
                "18446744073709551616",
                "9" * r.choice([21, 4_301, 20_000]),  # past int64 / past Python's int() limit
                "-" + "1" * r.choice([21, 5_000]),
                ("x\n\x1b[2J" * 20_000)[: r.choice([257, 5_000, 65_536])],  # echoed if it can be
                "\u202e",
                [],
                [1, "a", None],
                {},
                {"unknown": 1},
                self._nest(r.randint(2, 60)),
            ]
        )

    def _nest(self, levels: int) -> Any:
        out: Any = 1
        for _ in range(levels):
            out = [out] if self.rng.random() < 0.5 else {"k": out}
        return out

    def _paths(self, node: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        out = [path]
        if isinstance(node, dict):
            for k, v in node.items():
                out += self._paths(v, (*path, k))
        elif isinstance(node, list):
            for i, v in enumerate(node):
                out += self._paths(v, (*path, i))
        return out

    def mutate(self, msg: dict[str, Any]) -> Any:
        r = self.rng
        msg = copy.deepcopy(msg)
        for _ in range(r.choice([0, 0, 1, 1, 2, 3])):
            paths = self._paths(msg)
            path = r.choice(paths)
            op = r.choice(["replace", "replace", "delete", "insert", "id"])
            if not path:
                if op == "replace" and r.random() < 0.2:
                    return self._junk()
                continue
            parent: Any = msg
            for key in path[:-1]:
                parent = parent[key]
            last = path[-1]
            if op == "replace":
                parent[last] = self._junk()
            elif op == "delete":
                del parent[last]
            elif op == "insert" and isinstance(parent, dict):
                key = r.choice(["bogus", "Stream", "request_id", "requestId", "model", "loraName", "extra"])
                parent[key] = self._junk()
            elif op == "id" and isinstance(msg, dict):
                msg[r.choice(["stream", "call"])] = r.choice(
                    [-1, "", "y" * 129, 2**53, 1.0, None, [1], True, 7]
                )
        return msg

    # -- frames --------------------------------------------------------------------------------------

    def frame(self) -> Frame:
        r = self.rng
        roll = r.random()
        if roll < 0.03:
            return Frame(OP_TEXT, b'{"type":"cancel","stream":"\xff\xfe"}', "invalid-utf8")
        if roll < 0.05:
            return Frame(OP_BINARY, r.randbytes(r.randint(1, 64)), "random-bytes")
        if roll < 0.07:
            return Frame(
                OP_TEXT, bytes(r.randint(0x20, 0x7E) for _ in range(r.randint(1, 64))), "random-text"
            )
        if roll < 0.085:
            n = self.max_message_size + r.randint(1, 4096)
            return Frame(r.choice([OP_TEXT, OP_BINARY]), b"[" + b"1," * (n // 2) + b"1]", "oversized")
        if roll < 0.10:
            n = r.choice([40, 300, 900, 1_000, 5_000, 100_000])
            stream = self._stream()
            kind = r.choice(["top", "json", "msgpack"])
            if kind == "top":
                return Frame(OP_TEXT, ("[" * n + "]" * n).encode(), "deep")
            if kind == "json":  # a generate whose request nests n levels (built as text)
                head = json.dumps({"type": "generate", "stream": stream, "request": {"prompt": "x"}})[:-2]
                return Frame(OP_TEXT, (head + ',"extra":' + "[" * n + "]" * n + "}}").encode(), "deep-json")
            packed = msgspec.msgpack.encode({"type": "generate", "stream": stream})
            packed = bytes([packed[0] + 1]) + packed[1:] + msgspec.msgpack.encode("request")
            packed += b"\x82" + msgspec.msgpack.encode("prompt") + msgspec.msgpack.encode("x")
            packed += msgspec.msgpack.encode("extra") + b"\x91" * n + b"\xc0"
            return Frame(OP_BINARY, packed, "deep-msgpack")
        if roll < 0.11:
            return Frame(OP_TEXT, b"", "framing", raw=self._bad_framing())
        msg = self.mutate(self.seed_message())
        binary = r.random() < 0.4
        try:
            payload = msgspec.msgpack.encode(msg) if binary else json.dumps(msg).encode()
        except (OverflowError, msgspec.EncodeError, TypeError, ValueError):
            payload = json.dumps(msg, default=str).encode()
            binary = False
        kind = "msgpack" if binary else "json"
        if r.random() < 0.08 and payload:
            data = bytearray(payload)
            for _ in range(r.randint(1, 3)):
                data[r.randrange(len(data))] = r.randrange(256)
            payload = bytes(data)
            kind += "-corrupted"
        if len(payload) > self.max_message_size:
            kind = "oversized"
        return Frame(OP_BINARY if binary else OP_TEXT, payload, kind)

    def _bad_framing(self) -> bytes:
        r = self.rng
        return r.choice(
            [
                ws_frame(0x3, b"reserved opcode"),
                ws_frame(OP_TEXT, b"{}", rsv=4),  # RSV bit without an extension
                ws_frame(OP_PING, b"x" * 130),  # control frame > 125 bytes
                ws_frame(OP_PING, b"p", fin=False),  # fragmented control frame
                ws_frame(OP_TEXT, b"{}", masked=False),  # client frames must be masked
                ws_frame(0x0, b"continuation of nothing"),
            ]
        )
