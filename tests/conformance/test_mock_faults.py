"""The contract-violation fault switches added to the simulated engines for the suite (I/O-free)."""

from __future__ import annotations

import pytest

from sidecar.mock.faults import (
    ENGINE_FLAGS,
    STREAM_FLAGS,
    FaultSpecError,
    StreamFaults,
    parse_faults,
    parse_stream_faults,
)
from sidecar.mock.kvevents_wire import KvFaults


def test_flags_parse_and_take_no_value() -> None:
    f = parse_faults(sorted(ENGINE_FLAGS | STREAM_FLAGS))
    assert f.flags == ENGINE_FLAGS and f.stream.flags == STREAM_FLAGS
    assert all(f.has(n) for n in ENGINE_FLAGS) and all(f.stream.has(n) for n in STREAM_FLAGS)
    assert f.kv_options() == {
        "kv_wrong_rank": True,
        "kv_replay_skip": True,
        "kv_empty_response": True,
        "kv_event_after_error": True,
        "kv_undecodable": True,
    }
    with pytest.raises(FaultSpecError, match="takes no value"):
        parse_faults(["phantom-alias=1"])
    with pytest.raises(FaultSpecError, match="takes no value"):
        parse_faults(["skip-finish=2"])
    with pytest.raises(FaultSpecError, match="engine-wide"):
        parse_stream_faults(["any-model"])


def test_stream_flags_per_request_merge() -> None:
    assert parse_stream_faults(["status-after=2"]).status_after == 2
    assert parse_stream_faults(["status-after"]).status_after == 1
    assert parse_faults(["hold-after-terminal=1"]).hold_after_terminal == 1
    assert parse_faults(["hold-after-terminal"]).hold_after_terminal == -1  # every call
    engine = StreamFaults(stall=3, flags=frozenset({"no-stop-match"}))
    request = parse_stream_faults(["prompt-twice", "no-usage"])
    merged = engine.merged(request)
    assert merged.flags == {"no-stop-match", "prompt-twice"} and merged.stall == 3 and merged.no_usage
    assert StreamFaults(flags=frozenset({"early-usage"})).any


def test_kv_fault_offsets() -> None:
    kv = KvFaults.from_kv_options({"kv_wrong_rank": True, "kv_replay_skip": True})
    assert (kv.rank_offset, kv.replay_offset) == (1, 1)
    assert KvFaults.from_options([("kv-wrong-rank", None)]).wrong_rank
    flags = parse_faults(["kv-empty-response", "kv-event-after-error", "kv-undecodable"]).kv_options()
    kv = KvFaults.from_kv_options(flags)
    assert kv.empty_response and kv.event_after_error and kv.undecodable
    assert KvFaults.from_options([("kv-undecodable", None)]).undecodable
    assert (KvFaults().rank_offset, KvFaults().replay_offset) == (0, 0)
