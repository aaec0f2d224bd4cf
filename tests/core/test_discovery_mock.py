"""Discovery, admission and ``describe`` end to end against the simulated engines (real gRPC sockets)."""

from __future__ import annotations

import asyncio
import functools
import os
import re
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
import trio_asyncio

from sidecar.core.admission import admit
from sidecar.core.card import WorkerCard, card_from_json, card_to_json
from sidecar.core.discovery import compare_cards, discover
from sidecar.core.errors import NegotiationError, Rejection
from sidecar.mock.app import ServingInfo, serve_engine
from sidecar.mock.config import EngineConfig
from sidecar.mock.faults import Faults
from sidecar.openengine import pb
from sidecar.openengine.client import open_engine_client


@asynccontextmanager
async def mock_engine(**kw: Any) -> AsyncIterator[ServingInfo]:
    """One simulated engine in this process (asyncio, on the test's trio-asyncio loop)."""
    kw.setdefault("kv_events", "none")
    config = EngineConfig(fast=True, **kw)
    stop = asyncio.Event()
    ready: list[ServingInfo] = []
    started = trio.Event()

    def on_ready(info: ServingInfo) -> None:
        ready.append(info)
        started.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(
            trio_asyncio.aio_as_trio(functools.partial(serve_engine, config, stop=stop, on_ready=on_ready))
        )
        try:
            with trio.fail_after(10):
                await started.wait()
            yield ready[0]
        finally:
            stop.set()


async def discover_at(address: str, **kw: Any) -> WorkerCard:
    async with open_engine_client(address) as client:
        with trio.fail_after(10):
            return await discover(client, **kw)


FLAVOR_FACTS = {
    "vllm": ("vllm", "vllm.kv_transfer_params.v1", "nixl", False),
    "trtllm": ("tensorrt_llm", "tensorrt_llm.disaggregated_params.v1", "ucx", False),
    "sglang": ("sglang", "sglang.bootstrap.v1", "mooncake", True),
}


@pytest.mark.parametrize("flavor", ["vllm", "trtllm", "sglang"])
@pytest.mark.parametrize("role", ["aggregated", "prefill", "decode"])
async def test_discover_every_flavor_and_role(aio_loop: Any, flavor: str, role: str) -> None:
    async with mock_engine(flavor=flavor, role=role, aliases=("small",)) as serving:
        card = await discover_at(serving.address)
    name, profile, backend, bootstrap = FLAVOR_FACTS[flavor]
    assert card.problems == []
    assert card.engine.name == name and card.role == role
    assert card.engine.instance_id == serving.instance_id
    assert card.schema.revision == 3 and card.schema.release_kind == "commit"
    [model] = card.models
    assert model.aliases == ["small"] and card.resolve("small") is not None
    assert model.generation is not None and model.multimodal is not None
    assert card.lora_adapters == []  # LoRA enabled, nothing loaded
    assert card.dp_ranks == [0]
    kv = card.kv_connector
    assert kv is not None
    if role == "aggregated":
        assert kv.enabled is False
    else:
        assert (kv.handoff_profile, kv.transfer_backend, kv.uses_client_bootstrap) == (
            profile,
            backend,
            bootstrap,
        )
        if bootstrap and role == "prefill":
            assert kv.bootstrap_endpoint is not None
    card_to_json(card)


async def test_dp_ranks_and_kv_sources(aio_loop: Any) -> None:
    async with mock_engine(flavor="vllm", dp_size=2, kv_events="zmq") as serving:
        card = await discover_at(serving.address)
    assert card.dp_ranks == [0, 1]
    assert card.kv_event_sources is not None
    assert sorted(s.data_parallel_rank for s in card.kv_event_sources) == [0, 1]  # type: ignore[type-var]
    request = pb.GenerateRequest(model=card.models[0].served_model_name, prompt="hi")
    assert admit(request, {"openengine-target-dp-rank": "1"}, card).metadata.target_dp_rank == 1
    with pytest.raises(Rejection, match="not a DP rank"):
        admit(request, {"openengine-target-dp-rank": "2"}, card)


@pytest.mark.parametrize(
    ("faults", "reason"),
    [
        (Faults(wrong_revision=0), "schema_revision 0"),
        (
            Faults(wrong_revision=5, wrong_min_client=4),
            "minimum_client_revision 4: it requires a newer client",
        ),
        (Faults(wrong_min_client=4), "minimum_client_revision 4 above its own schema_revision 3"),
        (Faults(wrong_release="main"), "'main', not an immutable schema release"),
    ],
)
async def test_negotiation_failures(aio_loop: Any, faults: Faults, reason: str) -> None:
    async with mock_engine(faults=faults) as serving:
        with pytest.raises(NegotiationError, match=reason):
            await discover_at(serving.address)


async def test_expected_engine_and_release(aio_loop: Any) -> None:
    async with mock_engine(flavor="sglang") as serving:
        await discover_at(serving.address, expected_engine="sglang")
        with pytest.raises(NegotiationError, match="expected engine 'vllm'"):
            await discover_at(serving.address, expected_engine="vllm")
        with pytest.raises(NegotiationError, match=re.escape("expected schema release v9.9.9")):
            await discover_at(serving.address, expected_release="v9.9.9")


async def test_changed_role_after_restart_is_detected(aio_loop: Any) -> None:
    async with mock_engine(flavor="vllm", role="prefill") as serving:
        before = await discover_at(serving.address)
    async with mock_engine(flavor="vllm", role="prefill") as serving:
        same = await discover_at(serving.address)
    async with mock_engine(flavor="vllm", role="prefill", faults=Faults(wrong_role="decode")) as serving:
        changed = await discover_at(serving.address)
    assert compare_cards(before, same) == []
    assert compare_cards(before, changed) == ["engine role changed from prefill to decode"]


async def test_admission_matrix_against_mock_cards(aio_loop: Any) -> None:
    """The issue's media matrix, on cards the simulated engines report."""
    cards: dict[tuple[str, str], WorkerCard] = {}
    for flavor, role in [("trtllm", "prefill"), ("trtllm", "aggregated"), ("vllm", "aggregated")]:
        async with mock_engine(flavor=flavor, role=role) as serving:
            cards[flavor, role] = await discover_at(serving.address)

    def media(card: WorkerCard, modality: pb.Modality) -> pb.GenerateRequest:
        return pb.GenerateRequest(
            model=card.models[0].served_model_name,
            prompt="look",
            media=[pb.MediaItem(modality=modality, url="https://x/m")],
        )

    audio, video = pb.Modality.AUDIO, pb.Modality.VIDEO
    admit(media(cards["trtllm", "aggregated"], audio), {}, cards["trtllm", "aggregated"])
    with pytest.raises(Rejection, match="audio is not accepted on the prefill/decode path"):
        admit(media(cards["trtllm", "prefill"], audio), {}, cards["trtllm", "prefill"])
    with pytest.raises(Rejection, match="video is not accepted on the aggregated path"):
        admit(media(cards["vllm", "aggregated"], video), {}, cards["vllm", "aggregated"])


async def test_describe_command_against_mock(aio_loop: Any) -> None:
    async with mock_engine(flavor="sglang", role="prefill") as serving:
        env = {k: v for k, v in os.environ.items() if not k.startswith("OPENENGINE_SIDECAR_")}
        with trio.fail_after(30):
            done = await trio.run_process(
                [sys.executable, "-m", "sidecar", "describe", "--engine", serving.address, "--json"],
                capture_stdout=True,
                capture_stderr=True,
                check=False,
                env=env,
            )
    assert done.returncode == 0, done.stderr
    card = card_from_json(done.stdout)
    assert card.engine.name == "sglang" and card.role == "prefill" and card.problems == []
    assert card.kv_connector is not None and card.kv_connector.bootstrap_endpoint is not None
