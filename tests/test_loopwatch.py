"""The event-loop watch: a loop that cannot run says so (log, counter, lag histogram)."""

from __future__ import annotations

import logging
import re
import time
from functools import partial

import pytest
import trio

from sidecar.loopwatch import LOOP_STALLS, watch_loop
from sidecar.metrics_registry import REGISTRY


def lag_count() -> float:
    value = REGISTRY.get_sample_value("openengine_sidecar_event_loop_lag_seconds_count")
    return value or 0.0


async def test_a_blocked_loop_is_one_stall_with_its_length(caplog: pytest.LogCaptureFixture) -> None:
    stalls, lags = LOOP_STALLS._value.get(), lag_count()
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            await nursery.start(partial(watch_loop, tick=0.01, warn_after=0.4))
            await trio.sleep(0.1)  # the watch runs meanwhile: lags observed
            assert lag_count() > lags
            beyond = lag_count() - bucket("0.5")
            with caplog.at_level(logging.WARNING, logger="sidecar.loopwatch"):
                time.sleep(0.8)  # noqa: ASYNC251 (the loop cannot run: a blocking call)
                await trio.sleep(0.05)
            nursery.cancel_scope.cancel()
    assert LOOP_STALLS._value.get() >= stalls + 1
    said = [r.getMessage() for r in caplog.records if r.name == "sidecar.loopwatch"]
    assert any(re.search(r"event loop stalled: could not run for (0\.[89]|1\.\d)s", m) for m in said), said
    assert lag_count() - bucket("0.5") > beyond  # the stall is in the histogram, past 0.5 s


def bucket(le: str) -> float:
    return REGISTRY.get_sample_value("openengine_sidecar_event_loop_lag_seconds_bucket", {"le": le}) or 0.0
