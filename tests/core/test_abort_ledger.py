"""The Abort ledger (sidecar/core/abort_ledger.py): every transition of one request id's state,
and the ones it refuses."""

from __future__ import annotations

import pytest
import trio

from sidecar.core.abort_ledger import AbortLedger, AbortState
from sidecar.metrics_registry import REGISTRY


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_begin_then_finish_forgets_the_id() -> None:
    ledger = AbortLedger(4)
    ledger.begin("a", confirm=False)
    assert "a" in ledger and ledger.state("a") is AbortState.SENDING
    with pytest.raises(ValueError, match="already under way"):
        ledger.begin("a", confirm=False)
    assert ledger.finish("a") is False
    assert "a" not in ledger and ledger.state("a") is None and len(ledger) == 0


def test_not_found_is_confirmed_only_where_asked() -> None:
    ledger = AbortLedger(4)
    ledger.begin("silent", confirm=True)  # the engine sent nothing on the stream
    ledger.begin("spoke", confirm=False)
    ledger.answered_not_found("silent")
    ledger.answered_not_found("spoke")
    ledger.answered_not_found("unknown")  # no record: only wakes a re-delivery round
    assert ledger.engine_answered.is_set()
    assert ledger.finish("spoke") is False and "spoke" not in ledger
    assert ledger.finish("silent") is True
    assert ledger.state("silent") is AbortState.CONFIRMING and "silent" in ledger  # not admitted
    ledger.confirmed("silent")
    assert "silent" not in ledger


def test_no_confirmation_without_a_background() -> None:
    ledger = AbortLedger(4)
    ledger.begin("silent", confirm=True)
    ledger.answered_not_found("silent")
    assert ledger.finish("silent", can_confirm=False) is False and "silent" not in ledger


def test_park_take_and_redeliver() -> None:
    ledger = AbortLedger(4)
    parked0 = sample("openengine_sidecar_aborts_parked_total")
    ledger.begin("a", confirm=False)
    ledger.park("a")
    assert ledger.state("a") is AbortState.PARKED and ledger.backlog() == ["a"]
    assert sample("openengine_sidecar_aborts_parked_total") - parked0 == 1
    assert sample("openengine_sidecar_aborts_undelivered") == 1
    assert ledger.oldest_parked() == "a"
    assert ledger.take("a") is True and ledger.state("a") is AbortState.REDELIVERING
    assert ledger.take("a") is False  # being re-sent: not taken twice
    assert ledger.oldest_parked() is None
    assert ledger.redelivered("a", done=False) is False and ledger.state("a") is AbortState.PARKED
    assert ledger.take("a") is True
    assert ledger.redelivered("a", done=True) is False
    assert "a" not in ledger and ledger.backlog() == []
    assert sample("openengine_sidecar_aborts_undelivered") == 0


def test_a_redelivered_not_found_is_confirmed() -> None:
    ledger = AbortLedger(4)
    ledger.begin("a", confirm=True)
    ledger.park("a")
    ledger.take("a")
    ledger.answered_not_found("a")
    assert ledger.redelivered("a", done=True) is True and ledger.state("a") is AbortState.CONFIRMING


def test_a_full_backlog_drops_its_oldest() -> None:
    """The oldest parked id is dropped (counted) and free again; one being re-sent when it is
    dropped stays reserved until that attempt ends, then is forgotten whatever its answer."""
    ledger = AbortLedger(2)
    dropped0 = sample("openengine_sidecar_aborts_total", result="dropped")
    for rid in ("a", "b", "c"):
        ledger.begin(rid, confirm=False)
        ledger.park(rid)
    assert ledger.backlog() == ["b", "c"] and "a" not in ledger
    assert ledger.take("b")
    ledger.begin("d", confirm=False)
    ledger.park("d")  # drops "b" while it is re-sent
    assert ledger.backlog() == ["c", "d"] and ledger.state("b") is AbortState.REDELIVERING
    assert ledger.redelivered("b", done=False) is False and "b" not in ledger
    assert sample("openengine_sidecar_aborts_total", result="dropped") - dropped0 == 2


@pytest.mark.parametrize(
    ("step", "state"),
    [("park", "none"), ("finish", "none"), ("confirmed", "none"), ("take", None), ("redelivered", "none")],
)
def test_transitions_from_the_wrong_state_are_refused(step: str, state: str | None) -> None:
    ledger = AbortLedger(4)
    if step == "take":
        assert ledger.take("x") is False  # a question as much as a step: no error
        return
    with pytest.raises(ValueError, match=f"is {state}"):
        if step == "redelivered":
            ledger.redelivered("x", done=True)
        else:
            getattr(ledger, step)("x")
    ledger.begin("y", confirm=False)
    with pytest.raises(ValueError, match="is sending, not confirming"):
        ledger.confirmed("y")
    with pytest.raises(ValueError, match="is sending, not redelivering"):
        ledger.redelivered("y", done=True)


async def test_wait_parked_returns_once_one_is_parked() -> None:
    ledger = AbortLedger(4)
    got = trio.Event()

    async def waiter() -> None:
        await ledger.wait_parked()
        got.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
        await trio.testing.wait_all_tasks_blocked()
        ledger.begin("a", confirm=False)
        assert not got.is_set()
        ledger.park("a")
        with trio.fail_after(1):
            await got.wait()
