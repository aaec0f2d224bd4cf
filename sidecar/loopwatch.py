"""The event loop's own punctuality: the sidecar says when it could not run on time.

Everything the sidecar does (relaying tokens, answering PINGs and probes, sending Aborts)
runs on one trio thread. When that thread cannot run (the host's CPUs are taken by the
engine, a blocking call slipped in, the process was stopped), every client sees a hung
sidecar and nothing in the sidecar's own log says why. :func:`watch_loop` sleeps a short
tick at a time and measures how late each wake-up is: the lag is a histogram, and a lag past
``warn_after`` is a counted stall and one WARNING naming its length.
"""

from __future__ import annotations

import logging
from typing import NoReturn

import trio
from prometheus_client import Counter, Histogram

from sidecar.metrics_registry import REGISTRY

log = logging.getLogger(__name__)

#: How often the watch wakes (seconds).
TICK = 0.25
#: A wake-up later than this is a stall: counted and logged (seconds).
WARN_AFTER = 1.0

LOOP_LAG = Histogram(
    "openengine_sidecar_event_loop_lag_seconds",
    "How late the event loop woke for a timer (sampled every 0.25 s): time it could not run.",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
    registry=REGISTRY,
)
LOOP_STALLS = Counter(
    "openengine_sidecar_event_loop_stalls",
    "Event loop wake-ups more than 1 s late (CPU starvation, a blocking call, a stopped process).",
    registry=REGISTRY,
)


async def watch_loop(
    *,
    tick: float = TICK,
    warn_after: float = WARN_AFTER,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> NoReturn:
    """Measure each wake-up's lag for ever (cancel to stop): observed in ``LOOP_LAG``; one
    later than ``warn_after`` counts in ``LOOP_STALLS`` and logs a WARNING."""
    task_status.started()
    due = trio.current_time() + tick
    while True:
        await trio.sleep_until(due)
        now = trio.current_time()
        lag = now - due
        LOOP_LAG.observe(lag)
        if lag > warn_after:
            LOOP_STALLS.inc()
            log.warning(
                "event loop stalled: could not run for %.1fs (CPU starvation, a blocking call or a"
                " stopped process); clients saw no answer meanwhile",
                lag,
            )
        due = now + tick
