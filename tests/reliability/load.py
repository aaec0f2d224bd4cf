"""A load driver for the north protocol: many concurrent streams on a few connections, with
random cancels and abrupt disconnects, checking every stream's protocol on the way.

Used by ``tests/reliability/test_load.py`` (one bounded run) and ``scripts/soak`` (rounds for
a chosen duration). One *round* opens ``streams`` streams spread over ``connections``
WebSocket connections at once; each stream asks for a few tokens; a random share of the
streams is cancelled after a random number of events; a random share of the connections is
dropped abruptly (TCP RST, no close handshake) part way through. Every stream id and request
id is unique per round (``{tag}-{conn}-{i}``).

Client-side checks (``RoundReport.violations``): exactly one ``end`` per stream (except on a
dropped connection), nothing after a stream's ``end``, only expected frame types, outcomes
that fit what the client did.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import msgspec
import trio
from trio_websocket import ConnectionClosed

from tests.reliability.helpers import abort_socket, raw_ws

MODEL = "Qwen/Qwen3-0.6B"
_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode


@dataclass
class LoadConfig:
    streams: int = 1000
    connections: int = 8
    min_tokens: int = 4
    max_tokens: int = 16
    cancel_share: float = 0.3
    disconnect_share: float = 0.25
    seed: int = 0


@dataclass
class RoundReport:
    """What the client saw in one round (request ids by fate)."""

    completed: set[str] = field(default_factory=set)
    cancelled: set[str] = field(default_factory=set)  # ended ``cancelled`` after our cancel
    other_end: dict[str, str] = field(default_factory=dict)  # rejected / failed: id -> code
    lost: set[str] = field(default_factory=set)  # no end: their connection was dropped
    events: int = 0
    peak_open: int = 0  # streams that had an event and no end yet, at most at once
    seconds: float = 0.0
    violations: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return len(self.completed) + len(self.cancelled) + len(self.other_end) + len(self.lost)


class _Counter:
    def __init__(self) -> None:
        self.open = 0
        self.peak = 0

    def up(self) -> None:
        self.open += 1
        self.peak = max(self.peak, self.open)

    def down(self) -> None:
        self.open -= 1


async def _connection(
    url: str,
    tag: str,
    conn: int,
    n: int,
    cfg: LoadConfig,
    rng: random.Random,
    report: RoundReport,
    gauge: _Counter,
) -> None:
    plan = []
    for i in range(n):
        tokens = rng.randint(cfg.min_tokens, cfg.max_tokens)
        cancel_after = rng.randint(0, tokens - 1) if rng.random() < cfg.cancel_share else None
        plan.append((f"{tag}-{conn}-{i}", tokens, cancel_after))
    drop_after = None
    if rng.random() < cfg.disconnect_share:
        expected = sum(t + 1 for _, t, _ in plan)
        drop_after = rng.randint(1, max(1, expected // 2))
    events = [0] * n
    ended = [False] * n
    cancel_sent = [False] * n
    left = n
    async with raw_ws(url, message_queue_size=64) as (ws, sock):

        async def send_all() -> None:
            for i, (rid, tokens, _) in enumerate(plan):
                request = {
                    "model": MODEL,
                    "prompt": f"load {rid}",
                    "requestId": rid,
                    "stopping": {"maxTokens": tokens, "ignoreEos": True},
                }
                await ws.send_message(_encode({"type": "generate", "stream": i, "request": request}).decode())

        async with trio.open_nursery() as nursery:
            nursery.start_soon(send_all)
            seen = 0
            try:
                while left:
                    msg = _decode(await ws.get_message())
                    kind = msg.get("type")
                    i = msg.get("stream")
                    if kind not in ("event", "end") or not isinstance(i, int) or not 0 <= i < n:
                        report.violations.append(f"{tag}-{conn}: unexpected frame {str(msg)[:200]}")
                        continue
                    rid, _, cancel_after = plan[i]
                    if ended[i]:
                        report.violations.append(f"{rid}: {kind} after its end")
                        continue
                    if kind == "event":
                        if events[i] == 0:
                            gauge.up()
                        events[i] += 1
                        report.events += 1
                        seen += 1
                        if cancel_after is not None and events[i] > cancel_after and not cancel_sent[i]:
                            cancel_sent[i] = True
                            await ws.send_message(_encode({"type": "cancel", "stream": i}).decode())
                    else:
                        ended[i] = True
                        left -= 1
                        if events[i]:
                            gauge.down()
                        outcome = msg.get("outcome")
                        if outcome == "completed":
                            report.completed.add(rid)
                        elif outcome == "cancelled" and cancel_sent[i]:
                            report.cancelled.add(rid)
                        else:
                            code = (msg.get("error") or {}).get("code", "")
                            report.other_end[rid] = f"{outcome} {code}"
                    if drop_after is not None and seen >= drop_after:
                        abort_socket(sock)
                        await sock.aclose()  # the client vanishes: RST, no close handshake
                        break
            except ConnectionClosed as err:
                if drop_after is None:
                    report.violations.append(f"{tag}-{conn}: connection closed by the sidecar: {err}")
            nursery.cancel_scope.cancel()
    for i, (rid, _, _) in enumerate(plan):
        if not ended[i]:
            report.lost.add(rid)
            if events[i]:
                gauge.down()


async def run_round(url: str, cfg: LoadConfig, tag: str) -> RoundReport:
    """One round (see module doc); returns when every connection is done."""
    rng = random.Random(f"{cfg.seed}-{tag}")
    report = RoundReport()
    gauge = _Counter()
    per = [
        cfg.streams // cfg.connections + (1 if c < cfg.streams % cfg.connections else 0)
        for c in range(cfg.connections)
    ]
    t0 = trio.current_time()
    async with trio.open_nursery() as nursery:
        for conn, n in enumerate(per):
            nursery.start_soon(
                _connection, url, tag, conn, n, cfg, random.Random(rng.random()), report, gauge
            )
    report.seconds = trio.current_time() - t0
    report.peak_open = gauge.peak
    return report


def summary(report: RoundReport) -> dict[str, Any]:
    return {
        "streams": report.total,
        "completed": len(report.completed),
        "cancelled": len(report.cancelled),
        "lost_on_dropped_connections": len(report.lost),
        "other": len(report.other_end),
        "events": report.events,
        "peak_open": report.peak_open,
        "seconds": round(report.seconds, 2),
        "violations": len(report.violations),
    }
