from __future__ import annotations

from sidecar.core.card import card_from_json, card_to_json
from sidecar.core.load import LoadTracker
from sidecar.openengine import pb

from .shapes import vllm_card


def test_load_tracker() -> None:
    t = LoadTracker(stale_after=2.0)
    s = t.status(now=10.0)
    assert s.snapshot is None and s.stale and s.age_s is None and s.error_count == 0
    t.record_error("engine answered UNAVAILABLE")
    info = pb.LoadInfo(
        instance_id="i",
        running_requests=0,
        ranks=[pb.RankLoadInfo(data_parallel_rank=1, queued_requests=3)],
        attributes=pb.Struct.from_dict({"spec_accept": 0.5}),
    )
    t.record(info, now=11.0)
    s = t.status(now=12.5)
    assert not s.stale and s.age_s == 1.5
    assert s.error_count == 1 and s.consecutive_errors == 0 and s.last_error == "engine answered UNAVAILABLE"
    assert s.snapshot is not None
    assert s.snapshot.running_requests == 0 and s.snapshot.queued_requests is None
    assert s.snapshot.ranks[0].queued_requests == 3 and s.snapshot.ranks[0].running_requests is None
    assert s.snapshot.attributes == {"spec_accept": 0.5}
    t.record_error("timeout")
    t.record_error("timeout")
    s = t.status(now=14.0)
    assert s.stale and s.age_s == 3.0 and s.error_count == 3 and s.consecutive_errors == 2
    card = vllm_card()
    card.load = s
    assert card_from_json(card_to_json(card)).load == s
