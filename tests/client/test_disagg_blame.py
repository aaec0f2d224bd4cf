"""Which side of a failed client-bootstrap attempt the coordinator replaces
(``sidecar.client.disagg._bootstrap_blame``): judged from how both sides ended, never from which
failure arrived first — both start at once, so a dead prefill's refusal and the decode's failed
transfer from it race (on a busy machine the decode's often won, and the flow gave up)."""

from __future__ import annotations

from typing import Any

import pytest

from sidecar.client.disagg import _bootstrap_blame
from sidecar.client.disagg_flow import Side, Worker
from sidecar.client.sidecar_client import SidecarConnectionError
from sidecar.north import wire


class Stream:
    def __init__(self, end: wire.End | None) -> None:
        self.end = end
        self.kv_session_bytes = None


def side(
    role: Any, outcome: str | None, code: str | None = None, retryable: bool = False, events: int = 0
) -> Side:
    s = Side(role, Worker(f"ws://{role}", None, {}))  # type: ignore[arg-type]
    if outcome == "lost":
        s.lost = SidecarConnectionError("connection to sidecar closed")
        s.stream = Stream(None)  # type: ignore[assignment]
    elif outcome is not None:
        error = wire.ErrorBody(code=code, retryable=retryable) if code else None
        s.stream = Stream(wire.End(stream=1, outcome=outcome, error=error))  # type: ignore[assignment]
    s.events = events
    return s


REFUSED = ("rejected", "ERROR_CODE_INTERNAL", True)  # engine not ready
CANCELLED = ("cancelled", "ERROR_CODE_CANCELLED", True)  # by us, after the other side failed
TRANSFER = ("failed", "ERROR_CODE_KV_TRANSFER_FAILED", True)


@pytest.mark.parametrize(
    ("pre", "dec", "blame"),
    [
        (REFUSED, CANCELLED, "prefill"),  # the prefill's refusal came first
        (REFUSED, TRANSFER, "prefill"),  # the decode's failed transfer came first: the same
        (CANCELLED, TRANSFER, "prefill"),  # the transfer failed, the prefill was cancelled
        (("failed", "ERROR_CODE_INTERNAL", True), CANCELLED, "prefill"),  # e.g. its engine hung
        ("lost", TRANSFER, "prefill"),  # its sidecar hung or died
        (CANCELLED, ("rejected", "ERROR_CODE_OVERLOADED", True), "decode"),
        (CANCELLED, "lost", "decode"),
        (("completed", None, False), TRANSFER, None),  # the prefill did its part
        (CANCELLED, ("failed", "ERROR_CODE_INVALID_ARGUMENT", False), None),
    ],
)
def test_blame_follows_how_both_ended_not_which_came_first(pre: Any, dec: Any, blame: str | None) -> None:
    p = side("prefill", *pre) if isinstance(pre, tuple) else side("prefill", pre)
    d = side("decode", *dec) if isinstance(dec, tuple) else side("decode", dec)
    assert _bootstrap_blame(p, d) == blame


def test_no_failover_once_the_decode_relayed() -> None:
    assert _bootstrap_blame(side("prefill", *REFUSED), side("decode", *TRANSFER, events=2)) is None
