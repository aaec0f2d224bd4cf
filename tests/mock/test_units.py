"""I/O-free parts of the simulated engines: faults, scheduler, LoRA registry, flavours, counters."""

from __future__ import annotations

from pathlib import Path

import pytest

from sidecar.mock import flavors
from sidecar.mock.config import EngineConfig
from sidecar.mock.counters import MAX_TRACKED_IDS, GroundTruthCounters
from sidecar.mock.faults import Faults, FaultSpecError, StreamFaults, parse_faults, parse_stream_faults
from sidecar.mock.kvevents_wire import KvFaults
from sidecar.mock.lora import LoraError, LoraRegistry
from sidecar.mock.scheduler import Overloaded, RankScheduler, pick_rank
from sidecar.openengine import pb
from sidecar.openengine.releases import SCHEMA_RELEASE

# --- faults -------------------------------------------------------------------------


def test_fault_defaults_and_values() -> None:
    f = parse_faults(
        [
            "slow-start",
            "unhealthy=1.5",
            "wrong-revision",
            "wrong-min-client=9",
            "wrong-release",
            "wrong-role",
            "no-drain",
            "ignore-abort",
            "drop-aborts=2",
            "kv-gap=3",
            "kv-publisher-restart",
            "kv-history-lost=4",
            "kv-tagged-arrays",
            "stall=5",
            "no-usage",
            "token_after_finish",
            "error-after",
            "close-without-terminal=2",
            "crash-after=7",
        ],
        role="prefill",
    )
    assert f.slow_start == 2.0 and f.unhealthy_after == 1.5
    assert (f.wrong_revision, f.wrong_min_client, f.wrong_release, f.wrong_role) == (0, 9, "main", "decode")
    assert f.no_drain and f.ignore_abort and f.drop_aborts == 2
    assert f.kv_options() == {
        "kv_gap": 3,
        "kv_publisher_restart": 1,
        "kv_history_lost": 4,
        "kv_tagged_arrays": True,
    }
    assert f.stream == StreamFaults(
        close_without_terminal=2,
        error_after=1,
        crash_after=7,
        stall=5,
        no_usage=True,
        token_after_finish=True,
    )
    assert parse_faults(["drop-aborts"]).drop_aborts == -1
    assert parse_faults([]) == Faults() and not Faults().stream.any


def test_oversized_message_faults() -> None:
    f = parse_faults(["oversized-answer", "oversized-answer=ListLoras:70000", "oversized-event"])
    assert (f.oversized("GetLoad"), f.oversized("ListLoras"), f.oversized("Health")) == (8 << 20, 70000, None)
    assert f.stream.oversized_event == 8 << 20
    assert parse_stream_faults(["oversized-event=100"]).oversized_event == 100
    assert parse_faults(["kv-large-batch"]).kv_options() == {"kv_large_batch": 3_000_000}
    assert KvFaults.from_kv_options({"kv_large_batch": 5000}).large_batch == 5000
    assert KvFaults.from_options([("kv-large-batch", None)]).large_batch == 3_000_000


@pytest.mark.parametrize(
    "spec",
    [
        "nonsense",
        "stall=x",
        "stall=-1",
        "no-usage=1",
        "wrong-role=boss",
        "slow-start=-2",
        "unhealthy=x",
        "oversized-answer=Generate",
        "oversized-answer=GetLoad:0",
        "oversized-event=0",
    ],
)
def test_bad_fault_specs(spec: str) -> None:
    with pytest.raises(FaultSpecError):
        parse_faults([spec])


def test_stream_faults_per_request() -> None:
    assert parse_stream_faults(["stall=2"]).stall == 2
    with pytest.raises(FaultSpecError):
        parse_stream_faults(["ignore-abort"])
    merged = StreamFaults(stall=1).merged(StreamFaults(no_usage=True))
    assert merged == StreamFaults(stall=1, no_usage=True)


# --- scheduler ------------------------------------------------------------------------


def test_admission_runs_queues_then_overloads() -> None:
    s: RankScheduler[str] = RankScheduler(0, max_running=2, max_queue=1)
    assert s.admit("a") and s.admit("b")
    assert s.admit("c") is False
    with pytest.raises(Overloaded):
        s.admit("d")
    assert (len(s.running), s.queued, s.load) == (2, 1, 3)
    assert s.release("a") == ["c"]
    assert s.running == {"b", "c"} and s.queued == 0


def test_queue_orders_by_priority_then_arrival() -> None:
    s: RankScheduler[str] = RankScheduler(0, max_running=1, max_queue=10)
    s.admit("run")
    for name, prio in [("low", -1), ("mid1", 0), ("high", 5), ("mid2", 0)]:
        s.admit(name, prio)
    order = []
    current = "run"
    for _ in range(4):
        [current] = s.release(current)
        order.append(current)
    assert order == ["high", "mid1", "mid2", "low"]


def test_releasing_a_queued_item() -> None:
    s: RankScheduler[str] = RankScheduler(0, max_running=1, max_queue=5)
    s.admit("a")
    s.admit("b")
    s.admit("c")
    assert s.release("b") == []
    assert s.release("a") == ["c"]


def test_pick_rank() -> None:
    ranks: list[RankScheduler[str]] = [RankScheduler(r, 4, 4) for r in range(3)]
    ranks[0].admit("x")
    ranks[1].admit("y")
    assert pick_rank(ranks).rank == 2
    assert pick_rank(ranks, 1).rank == 1
    ranks[2].admit("z")
    assert pick_rank(ranks).rank == 0


# --- LoRA -------------------------------------------------------------------------------


def _adapter(i: int, name: str, path: Path | str) -> pb.LoraAdapter:
    return pb.LoraAdapter(lora_id=i, lora_name=name, source_path=str(path))


def test_lora_rules(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    reg = LoraRegistry(enabled=True, max_loras=2)
    a, again = reg.load(_adapter(1, "a", tmp_path / "a"))
    assert not again and a.name == "a"
    assert reg.load(_adapter(1, "a", tmp_path / "a"))[1] is True
    for bad, status in [
        (_adapter(0, "x", tmp_path / "a"), "INVALID_ARGUMENT"),
        (_adapter(3, "", tmp_path / "a"), "INVALID_ARGUMENT"),
        (_adapter(3, "x", "relative/path"), "INVALID_ARGUMENT"),
        (_adapter(1, "other", tmp_path / "b"), "ALREADY_EXISTS"),
        (_adapter(2, "a", tmp_path / "b"), "ALREADY_EXISTS"),
        (_adapter(2, "other", tmp_path / "a"), "ALREADY_EXISTS"),
        (_adapter(2, "missing", tmp_path / "nope"), "NOT_FOUND"),
    ]:
        with pytest.raises(LoraError) as info:
            reg.load(bad)
        assert info.value.status == status, bad
    reg.load(_adapter(2, "b", tmp_path / "b"))
    (tmp_path / "c").mkdir()
    with pytest.raises(LoraError) as info:
        reg.load(_adapter(3, "c", tmp_path / "c"))
    assert info.value.status == "RESOURCE_EXHAUSTED"
    assert [x.name for x in reg.adapters()] == ["a", "b"]
    assert reg.unload("a").lora_id == 1
    with pytest.raises(LoraError) as info:
        reg.unload("a")
    assert info.value.status == "NOT_FOUND"


def test_lora_disabled() -> None:
    reg = LoraRegistry(enabled=False, max_loras=2)
    for call in (lambda: reg.load(_adapter(1, "a", "/x")), lambda: reg.unload("a")):
        with pytest.raises(LoraError) as info:
            call()
        assert info.value.status == "FAILED_PRECONDITION"


# --- flavours -------------------------------------------------------------------------

EXPECTED = {
    "trtllm": ("tensorrt_llm", "tensorrt_llm.disaggregated_params.v1", "ucx", False),
    "vllm": ("vllm", "vllm.kv_transfer_params.v1", "nixl", False),
    "sglang": ("sglang", "sglang.bootstrap.v1", "mooncake", True),
}
M = pb.Modality
MODALITIES = {
    "trtllm": ([M.IMAGE, M.VIDEO, M.AUDIO], [M.IMAGE, M.VIDEO]),
    "vllm": ([M.IMAGE], [M.IMAGE]),
    "sglang": ([M.IMAGE, M.VIDEO, M.AUDIO], [M.IMAGE, M.VIDEO]),
}


@pytest.mark.parametrize("flavor", ["trtllm", "vllm", "sglang"])
@pytest.mark.parametrize("role", ["aggregated", "prefill", "decode"])
def test_server_info_per_flavor_and_role(flavor: str, role: str) -> None:
    cfg = EngineConfig(flavor=flavor, role=role, dp_size=2, max_running=8, total_kv_blocks=100)  # type: ignore[arg-type]
    ep = pb.KvEndpoint(host="127.0.0.1", port=1234, protocol="tcp")
    info = flavors.server_info(cfg, instance="i", endpoints=[ep])
    name, profile, backend, bootstrap = EXPECTED[flavor]
    assert info.engine_name == name
    assert info.engine_role == flavors.role_enum(role)
    assert (info.schema_revision, info.minimum_client_revision, info.schema_release) == (3, 1, SCHEMA_RELEASE)
    assert info.capacity == pb.DeploymentCapacity(
        kv_block_size=16,
        total_kv_blocks=200,
        max_running_requests=16,
        max_batched_tokens=info.capacity.max_batched_tokens,
        max_loras=4,
    )
    assert info.parallelism is not None and info.parallelism.data_parallel_size == 2
    kv = info.kv_connector
    assert kv is not None
    if role == "aggregated":
        assert kv.enabled is False
    else:
        assert kv.enabled is True
        assert (kv.handoff_profile, kv.transfer_backend) == (profile, backend)
        assert kv.supports_client_bootstrap is bootstrap
        assert kv.local_endpoints == [ep]


@pytest.mark.parametrize("flavor", ["trtllm", "vllm", "sglang"])
def test_model_info_multimodal(flavor: str) -> None:
    mi = flavors.model_info(EngineConfig(flavor=flavor, aliases=("a",)))  # type: ignore[arg-type]
    mm = mi.multimodal_capabilities
    assert mm is not None
    agg, pd = MODALITIES[flavor]
    assert (mm.aggregate_modalities, mm.prefill_decode_modalities) == (agg, pd)
    assert mm.routing_image_token_id == 3
    assert mi.served_model_aliases == ["a"] and mi.served_model_name == flavors.DEFAULT_MODEL
    g = mi.generation
    assert g is not None and g.output_logprobs is not None and g.output_logprobs.supported is True
    assert g.max_num_sequences and g.max_num_sequences > 1
    assert mi.supports_lora is True


def test_faults_falsify_discovery() -> None:
    cfg = EngineConfig(faults=parse_faults(["wrong-revision=7", "wrong-release", "wrong-role=decode"]))
    info = flavors.server_info(cfg, instance="i")
    assert (info.schema_revision, info.schema_release, info.engine_role) == (7, "main", pb.EngineRole.DECODE)


# --- counters ---------------------------------------------------------------------------


def test_counters_snapshot_and_id_cap() -> None:
    c = GroundTruthCounters(dp_size=2)
    c.rejected("INVALID_ARGUMENT")
    for i in range(MAX_TRACKED_IDS + 3):
        c.abort_received(f"r{i}")
    c.abort_received("r0")
    snap = c.snapshot(in_flight=1, kv_sessions_open=2)
    assert snap["aborts_received"] == MAX_TRACKED_IDS + 4
    assert snap["aborts_received_by_id"]["r0"] == 2
    assert snap["aborts_untracked_ids"] == 3
    assert snap["rejected_by_status"] == {"INVALID_ARGUMENT": 1}
    assert snap["served_by_rank"] == {"0": 0, "1": 0}
    assert (snap["requests_in_flight"], snap["kv_sessions_open"]) == (1, 2)
