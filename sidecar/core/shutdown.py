"""How long stopping may take: the one place the shutdown budget is computed.

On SIGTERM ``run`` computes one deadline, :func:`stop_timeout` seconds away, and everything it
does to stop — leave Dynamo, drain, cancel what is left, send the last frames, close the
connections — happens before it; whatever still runs then is cancelled (its nursery is). The
drain uses :func:`stop_budget` for its last step; the deploy files (systemd ``TimeoutStopSec``,
Kubernetes ``terminationGracePeriodSeconds``) must allow more than :func:`stop_timeout`.
"""

from __future__ import annotations

#: Seconds, after the last Abort attempt, for every connection to send its last frames
#: (``end``) and its close frame.
CLOSE_MARGIN = 1.0


def stop_budget(abort_timeout: float) -> float:
    """Seconds from cancelling the streams still running to the exit: each cancelled stream
    makes at most one Abort attempt, bounded by ``abort_timeout`` (``StreamSupervisor.abort``;
    later tries are background retries that do not hold the exit), then the connections close
    within :data:`CLOSE_MARGIN`."""
    return abort_timeout + CLOSE_MARGIN


def stop_timeout(drain_timeout: float, abort_timeout: float, leave: float = 0.0) -> float:
    """Longest time from the stop signal to the exit: ``leave`` (the Dynamo plane leaving
    discovery, ``DynamoPlane.leave_budget``), the drain grace, then :func:`stop_budget`."""
    return leave + drain_timeout + stop_budget(abort_timeout)
