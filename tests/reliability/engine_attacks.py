"""Hostile input the sidecar takes from its engine, measured like the client attacks of
:mod:`tests.reliability.attacks` (the same :class:`~tests.reliability.attacks.Scenario`, bar
and :func:`~tests.reliability.attacks.run_scenario`; docs/SECURITY.md "Engine").

The engine is trusted for content, not for sizes: a simulated engine with an ``oversized-*``
fault (``sidecar/mock/faults.py``) sends messages far over the sidecar's bounds. Used by
``tests/reliability/test_hostile_engine.py`` (assertions) and ``scripts/attack`` (figures).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio

from sidecar.north import codec, wire
from tests.e2e.harness import Sidecar, generate_request
from tests.fuzz.rawws import Closed, RawWs
from tests.reliability.attacks import ATTACKER, Attack, Scenario
from tests.reliability.helpers import scrape

MIB = 1024 * 1024
#: The size of the engine's messages in the scenarios: 16 times the default bound.
HUGE = 64 * MIB
OVERSIZED_ID = "oversized"


def oversized_generate_event(size: int) -> Attack:
    """One stream whose engine sends a ``size``-byte token event after its first one (mock
    fault ``oversized-event``), read to its ``end`` (outcome and message in the notes)."""

    @asynccontextmanager
    async def attack(sc: Sidecar) -> AsyncIterator[dict[str, Any]]:
        notes: dict[str, Any] = {"event_bytes": size, "outcome": "no end within 60s"}
        faults = {"mock": {"faults": [f"oversized-event={size}"]}}
        request = generate_request(max_tokens=64, requestId=OVERSIZED_ID, extra=faults)
        ws = await RawWs.connect(sc.ws, source=ATTACKER)
        try:
            await ws.send_text(json.dumps({"type": "generate", "stream": 1, "request": request}))
            with trio.move_on_after(60):
                while not isinstance(msg := codec.decode_server_frame(await ws.next()), wire.End):
                    pass
                notes["outcome"] = msg.outcome + (f" {msg.error.code}" if msg.error else "")
                notes["retryable"] = bool(msg.error and msg.error.retryable)
                notes["message"] = msg.error.message if msg.error else ""
        except Closed as err:
            notes["outcome"] = f"closed {err.code}"
        yield notes
        await ws.aclose()

    return attack


@asynccontextmanager
async def polled(sc: Sidecar) -> AsyncIterator[dict[str, Any]]:
    """Nothing but the sidecar's own GetLoad polls (every second) while the attack holds;
    the failed ones counted in the notes."""
    notes: dict[str, Any] = {}
    yield notes
    notes["load_poll_errors"] = int(
        (await scrape(sc.http)).value("openengine_sidecar_load_poll_errors_total")
    )


SCENARIOS = {
    "engine-event": Scenario(
        "engine",
        f"a {HUGE // MIB} MiB Generate event",
        oversized_generate_event(HUGE),
        engine_args=("--token-delay-ms", "5"),
    ),
    "engine-answer": Scenario(
        "engine",
        f"{HUGE // MIB} MiB GetLoad answers (every poll)",
        polled,
        engine_args=("--fault", f"oversized-answer=GetLoad:{HUGE}"),
        hold=5,
    ),
}
