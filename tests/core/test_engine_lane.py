"""The lane of engine calls made for clients (``sidecar.core.engine_lane``): bounded in total
and per owner, refused at once when full, slots returned however the call ends."""

from __future__ import annotations

import pytest

from sidecar.core.engine_lane import EngineCallLane
from sidecar.core.errors import Rejection
from sidecar.openengine import pb


def test_full_lane_and_full_share_are_refused_at_once() -> None:
    lane = EngineCallLane(capacity=3, per_owner=2)
    a, b = object(), object()
    with lane.slot(a), lane.slot(a):
        with pytest.raises(Rejection) as share:
            with lane.slot(a):
                pass
        assert share.value.code == pb.ErrorCode.OVERLOADED and share.value.retryable
        assert "per connection" in share.value.message
        with lane.slot(b):
            with pytest.raises(Rejection) as full:
                with lane.slot(b):
                    pass
            assert full.value.code == pb.ErrorCode.OVERLOADED and full.value.retryable
        assert lane.in_use == 2
    assert lane.in_use == 0 and not lane._owners


def test_slots_come_back_when_the_call_fails() -> None:
    lane = EngineCallLane(capacity=1, per_owner=1)
    for _ in range(3):
        with pytest.raises(RuntimeError), lane.slot("x"):
            raise RuntimeError("engine call failed")
    with lane.slot("x"):
        assert lane.in_use == 1


def test_zero_means_no_limit() -> None:
    lane = EngineCallLane(capacity=0, per_owner=0)
    slots = [lane.slot("x") for _ in range(500)]
    for slot in slots:
        slot.__enter__()
    assert lane.in_use == 500
