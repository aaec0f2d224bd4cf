"""The fuzz harness itself stays runnable and finds nothing on a fixed seed (a short run; the
long ones are ``python -m tests.fuzz.harness --seconds N``)."""

from __future__ import annotations

from tests.fuzz.harness import fuzz


def test_harness_short_run_finds_nothing() -> None:
    n, findings, outcomes = fuzz(seed="ci", frames=3000, max_message_size=65536)
    assert n == 3000 and findings == 0
    for kind in (
        "admitted",
        "close 1007",
        "close 1009",
        "answer End",
        "answer ProtocolErrorMessage",
        "CancelCommand",
    ):
        assert outcomes[kind] > 0, (kind, dict(outcomes))
