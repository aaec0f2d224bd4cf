"""The KV bridge's spans (tracing on): a replayed gap and a resync each show up as a span of their
own, from a real bridge in front of a simulated engine with the fault injected."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio
import trio_asyncio
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from sidecar.mock.faults import parse_faults
from sidecar.openengine.client import open_engine_client
from sidecar.tracing import TracingConfig
from sidecar.tracing.otel import build_tracer
from tests.kvbridge.helpers import start_bridge
from tests.kvbridge.test_mock_e2e import RANKS, consume, flat, ground_truth, workload
from tests.mock_engines import mock_engine_in_process


async def bridge_spans(
    tmp_path: Path, flavor: str, fault: str, lost: int | None = None
) -> list[ReadableSpan]:
    """Run the workload through a traced bridge with ``fault``; the spans it made once every
    event got through (``lost``: that batch never does; an ``AllBlocksCleared`` comes instead)."""
    exporter = InMemorySpanExporter()
    tracer = build_tracer(TracingConfig(None, 64), exporter=exporter)
    log = tmp_path / "kv.jsonl"
    with trio.fail_after(20):
        async with (
            mock_engine_in_process(
                flavor=flavor,
                dp_size=RANKS,
                fast=True,
                total_kv_blocks=48,
                kv_log=str(log),
                faults=parse_faults([fault]),
            ) as eng,
            open_engine_client(eng.address) as client,
            trio.open_nursery() as nursery,
        ):
            info = await start_bridge(nursery, None, client=client, tracer=tracer)
            if flavor != "trtllm":
                for pub in eng.engine.kv_events.publishers.values():
                    await trio_asyncio.aio_as_trio(pub.wait_subscribers)()
            await workload(client)
            truth = ground_truth(log)
            for rank in range(RANKS):
                batches = truth[rank]
                if lost is not None:
                    batches = [*batches[:lost], [{"type": "AllBlocksCleared"}], *batches[lost + 1 :]]
                await consume(info, rank, len(flat(batches, flavor)))
            nursery.cancel_scope.cancel()
    tracer.shutdown()  # exports what is queued
    return list(exporter.get_finished_spans())


def attrs(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


@pytest.mark.parametrize(("flavor", "transport"), [("vllm", "zmq"), ("trtllm", "grpc")])
async def test_a_replayed_gap_is_a_span(
    aio_loop: object, tmp_path: Path, flavor: str, transport: str
) -> None:
    spans = await bridge_spans(tmp_path, flavor, "kv-gap=3")
    replays = sorted(
        (s for s in spans if s.name == "kv.replay"), key=lambda s: attrs(s)["openengine.kv.rank"]
    )
    assert [attrs(s)["openengine.kv.rank"] for s in replays] == list(range(RANKS))
    for span in replays:
        a = attrs(span)
        assert a["openengine.kv.transport"] == transport
        assert a["openengine.kv.gap.missing"] == 1 and a["openengine.kv.replay.start"] == 3
        assert a["openengine.kv.replay.outcome"] == "ok" and a["openengine.kv.replay.batches"] >= 1
        assert span.parent is None and span.status.is_ok
    assert not [s for s in spans if s.name == "kv.resync"]


async def test_lost_history_is_a_resync_span(aio_loop: object, tmp_path: Path) -> None:
    spans = await bridge_spans(tmp_path, "vllm", "kv-history-lost=3", lost=3)
    resyncs = [attrs(s) for s in spans if s.name == "kv.resync"]
    assert sorted(r["openengine.kv.rank"] for r in resyncs) == list(range(RANKS))
    assert {r["openengine.kv.resync.reason"] for r in resyncs} == {"history_lost"}
