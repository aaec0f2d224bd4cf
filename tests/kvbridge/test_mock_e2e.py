"""End to end: each mock engine flavour as the source (discovered through the real EngineClient),
the bridge, and the independent consumer, judged against the mock's ground-truth cache log."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
import trio_asyncio

from sidecar.kvbridge import KvBridgeInfo
from sidecar.mock.faults import parse_faults
from sidecar.openengine import pb
from sidecar.openengine.client import EngineClient, open_engine_client
from tests.fake_engine import apply
from tests.kvbridge.consumer import Consumer
from tests.kvbridge.helpers import CLEARED, Metrics, start_bridge
from tests.mock_engines import mock_engine_in_process, run_mock_engine

RANKS = 2
REQUESTS = 8  # per rank; each makes one or more KV batches (prefill, decode blocks, evictions)


def ground_truth(path: Path) -> dict[int, list[list[dict[str, Any]]]]:
    """Per rank, the batches of the mock's ``--kv-log`` (JSON lines, documented in KvGroundTruth)."""
    out: dict[int, list[list[dict[str, Any]]]] = {}
    for line in path.read_text().splitlines():
        entry = json.loads(line)
        out.setdefault(int(entry["rank"]), []).append(entry["events"])
    return out


def as_published(ev: dict[str, Any], flavor: str, arrays: bool = False) -> Any:
    """A ground-truth event as the bridge must publish it: a ZMQ flavour's event as its engine
    writes it (``arrays``: tagged arrays, the ``kv-tagged-arrays`` fault), a gRPC one (trtllm)
    in vLLM's map form."""
    t = ev["type"]
    if t == "AllBlocksCleared":
        return [t] if arrays else {"type": t}
    if t == "BlockRemoved":
        return [t, ev["block_hashes"], ev.get("medium")] if arrays else ev
    lora = ev.get("lora_name")
    if flavor == "sglang" and ev.get("cache_salt") is not None:  # older SGLang's map in the lora_name slot
        lora = {"cache_salt": ev["cache_salt"], "session_id": ev.get("session_id")}
    fields = {k: ev[k] for k in ("block_hashes", "parent_block_hash", "token_ids", "block_size")}
    fields.update(lora_id=ev.get("lora_id"), medium=ev.get("medium"), lora_name=lora)
    extra = ev.get("extra_keys")
    if extra is not None and any(extra):
        fields["extra_keys"] = extra
    return [t, *fields.values()] if arrays else {"type": t, **fields}


def flat(batches: list[list[dict[str, Any]]], flavor: str, arrays: bool = False) -> list[Any]:
    return [as_published(e, flavor, arrays) for b in batches for e in b]


async def workload(client: EngineClient, n: int = REQUESTS) -> None:
    """Requests on every rank: shared prefixes (cache hits), salted and LoRA-free, enough to evict."""
    for i in range(n):
        for rank in range(RANKS):
            words = (
                " ".join(f"p{i % 3}w{j}" for j in range(24)) + " " + " ".join(f"u{i}x{j}" for j in range(16))
            )
            req = pb.GenerateRequest(
                request_id=f"r{rank}-{i}",
                prompt=words,
                stopping=pb.StoppingOptions(max_tokens=20),
                kv=pb.KvOptions(cache_salt=f"salt{i}") if i % 4 == 1 else None,
            )
            async with client.generate(req, metadata={"openengine-target-dp-rank": str(rank)}) as stream:
                async for _ in stream:
                    pass


@asynccontextmanager
async def mock_and_bridge(
    tmp_path: Path, flavor: str, faults: list[str], **engine: Any
) -> AsyncIterator[tuple[EngineClient, KvBridgeInfo, Path]]:
    log = tmp_path / "kv.jsonl"
    async with (
        mock_engine_in_process(
            flavor=flavor,
            dp_size=RANKS,
            fast=True,
            total_kv_blocks=48,
            kv_log=str(log),
            faults=parse_faults(faults),
            **engine,
        ) as eng,
        open_engine_client(eng.address) as client,
        trio.open_nursery() as nursery,
    ):
        info = await start_bridge(nursery, None, client=client)  # discovery through GetKvEventSources
        assert [r.rank for r in info.ranks] == list(range(RANKS))
        assert {r.source for r in info.ranks} == {"grpc" if flavor == "trtllm" else "zmq"}
        if flavor != "trtllm":  # the bridge's SUBs reached the engine before any event exists
            for pub in eng.engine.kv_events.publishers.values():
                await trio_asyncio.aio_as_trio(pub.wait_subscribers)()
        yield client, info, log
        nursery.cancel_scope.cancel()


async def consume(info: KvBridgeInfo, rank: int, n_events: int) -> Consumer:
    r = info.ranks[rank]
    async with Consumer(r.publish_endpoint, r.replay_endpoint) as c:
        await c.collect_events(n_events)
        return c


def events_of(c: Consumer) -> list[Any]:
    return [e for r in c.received for e in r.events]


ZMQ_CASES = [
    ("vllm", [], {}),
    ("sglang", [], {}),
    ("vllm", ["kv-tagged-arrays"], {}),
    ("sglang", ["kv-tagged-arrays"], {}),
]


@pytest.mark.parametrize(("flavor", "faults", "engine"), [*ZMQ_CASES, ("trtllm", [], {})])
async def test_every_event_exactly_once_in_order(
    aio_loop: object, tmp_path: Path, flavor: str, faults: list[str], engine: dict[str, Any]
) -> None:
    with trio.fail_after(20):
        async with mock_and_bridge(tmp_path, flavor, faults, **engine) as (client, info, log):
            await workload(client)
            truth = ground_truth(log)
            for rank in range(RANKS):
                assert len(truth[rank]) >= REQUESTS
                expected = flat(truth[rank], flavor, "kv-tagged-arrays" in faults)
                c = await consume(info, rank, len(expected))
                assert events_of(c) == expected
                assert len(c.received) == len(truth[rank])  # one output batch per engine batch
                assert {p.rank for p in c.received} == {rank}
            if flavor == "sglang" and not faults:
                assert any(
                    isinstance(e.get("lora_name"), dict) for b in truth.values() for e in flat(b, flavor)
                )


@pytest.mark.parametrize("flavor", ["vllm", "sglang", "trtllm"])
async def test_injected_gap_is_recovered(aio_loop: object, tmp_path: Path, flavor: str) -> None:
    with trio.fail_after(20):
        async with mock_and_bridge(tmp_path, flavor, ["kv-gap=3"]) as (client, info, log):
            m0, m1 = Metrics(0), Metrics(1)
            await workload(client)
            truth = ground_truth(log)
            for rank in range(RANKS):
                expected = flat(truth[rank], flavor)
                c = await consume(info, rank, len(expected))
                assert events_of(c) == expected  # replayed (ZMQ) / resumed (gRPC): nothing cleared
            assert m0.delta("gaps") == m1.delta("gaps") == 1
            assert m0.delta("replays", outcome="ok") == 1


@pytest.mark.parametrize("flavor", ["vllm", "sglang"])
@pytest.mark.parametrize(
    ("fault", "reason"), [("kv-history-lost=3", "history_lost"), ("kv-publisher-restart=3", "restart")]
)
async def test_lost_history_and_restart_clear_then_live_zmq(
    aio_loop: object, tmp_path: Path, flavor: str, fault: str, reason: str
) -> None:
    with trio.fail_after(20):
        async with mock_and_bridge(tmp_path, flavor, [fault]) as (client, info, log):
            m = Metrics(0)
            await workload(client)
            truth = ground_truth(log)
            for rank in range(RANKS):
                batches = truth[rank]
                if reason == "history_lost":  # batch 3 never reaches anyone
                    expected = [*flat(batches[:3], flavor), CLEARED, *flat(batches[4:], flavor)]
                else:  # batch 3 is the restarted publisher's seq 0
                    expected = [*flat(batches[:3], flavor), CLEARED, *flat(batches[3:], flavor)]
                c = await consume(info, rank, len(expected))
                assert events_of(c) == expected
            assert m.delta("resyncs", reason=reason) == 1


@pytest.mark.parametrize(
    ("fault", "reason"), [("kv-history-lost=3", "history_lost"), ("kv-publisher-restart=3", "restart")]
)
async def test_lost_history_and_restart_take_a_snapshot_grpc(
    aio_loop: object, tmp_path: Path, fault: str, reason: str
) -> None:
    with trio.fail_after(20):
        async with mock_and_bridge(tmp_path, "trtllm", [fault]) as (client, info, log):
            m = Metrics(0)
            await workload(client)
            truth = ground_truth(log)
            for rank in range(RANKS):
                r = info.ranks[rank]
                async with Consumer(r.publish_endpoint, r.replay_endpoint) as c:
                    want: dict[Any, Any] = {}
                    apply(want, flat(truth[rank], "trtllm"))
                    # the snapshot makes the consumer's view equal to the engine's cache
                    await c.collect(
                        lambda rs, want=want: (
                            view(rs) == want.keys() and any(p.events == [CLEARED] for p in rs)
                        )
                    )
                    # before the fault: the engine's batches as they were; then AllBlocksCleared
                    assert [p.events for p in c.received[:3]] == [
                        flat([b], "trtllm") for b in truth[rank][:3]
                    ]
                    assert c.received[3].events == [CLEARED]
            assert m.delta("resyncs", reason=reason) == 1


def view(received: list[Any]) -> set[Any]:
    cache: dict[Any, Any] = {}
    apply(cache, [e for p in received for e in p.events])
    return set(cache)


@pytest.mark.parametrize("flavor", ["vllm", "trtllm"])
async def test_engine_subprocess_with_a_gap(aio_loop: object, tmp_path: Path, flavor: str) -> None:
    """A real engine process (``mock-engine``), its ground truth read from its ``--kv-log`` file."""
    log = tmp_path / "kv.jsonl"
    with trio.fail_after(30):
        async with (
            run_mock_engine(
                tmp_path,
                flavor,
                faults=["kv-gap=2"],
                dp_size=RANKS,
                fast=True,
                total_kv_blocks=48,
                kv_log=str(log),
            ) as eng,
            open_engine_client(eng.address) as client,
            trio.open_nursery() as nursery,
        ):
            info = await start_bridge(nursery, None, client=client)
            await workload(client)
            truth = ground_truth(log)
            for rank in range(RANKS):
                expected = flat(truth[rank], flavor)
                c = await consume(info, rank, len(expected))
                assert events_of(c) == expected
            nursery.cancel_scope.cancel()
