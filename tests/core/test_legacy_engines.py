"""Engines built on today's OpenEngine schemas are served (issue 16, findings 1-3), over real gRPC.

The scriptable fake engine answers exactly what an engine of each schema advertises; ``describe``
runs as a real process, ``run``'s startup in this process (its WARNING lines are asserted).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import AsyncIterator
from typing import Any

import pytest
import trio

from sidecar.core.card import WorkerCard
from sidecar.core.errors import Rejection
from sidecar.core.handoff import check_decode_session
from sidecar.core.int64 import json_decode
from sidecar.core.sidecar import Sidecar, SidecarConfig, StartupError
from sidecar.openengine import pb
from sidecar.openengine.client import open_engine_client
from tests.core.shapes import R, vllm_info
from tests.openengine.fake_grpc_engine import FakeGrpcEngine, RunningServer

DEF = "4def7c50b05e0674a0c3b26917399155535966e4"
B31 = "31be5dbeaaf5737a008abe9d29f0c07f3e80a4ef"
BSR = "334e348dc5854e4b99a3a0d25d8ff376"
UNKNOWN = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
async def engine(aio_loop: Any) -> AsyncIterator[RunningServer]:
    fake = FakeGrpcEngine()
    info, models = vllm_info()
    fake.unary["GetServerInfo"] = lambda r: info
    fake.unary["GetModelInfo"] = lambda r: models[r.model]
    fake.unary["ListLoras"] = lambda r: pb.ListLorasResponse()
    server = RunningServer(fake)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


def advertise(engine: RunningServer, **changes: Any) -> pb.ServerInfo:
    """Make the fake engine advertise ``vllm_info`` with ``changes`` (``role=`` too)."""
    info, models = vllm_info(changes.pop("role", R.AGGREGATED))
    for name, value in changes.items():
        setattr(info, name, value)
    engine.engine.unary["GetServerInfo"] = lambda r: info
    engine.engine.unary["GetModelInfo"] = lambda r: models[next(iter(models))]
    return info


def legacy(info: pb.ServerInfo, models: dict[str, pb.ModelInfo] | None = None) -> None:
    """Strip what the 4def7c5 schema does not define."""
    if info.kv_connector is not None:
        info.kv_connector.handoff_profile = ""
        info.kv_connector.supports_client_bootstrap = None
    for mi in (models or {}).values():
        mi.tokenizer = None
        mi.multimodal_capabilities = None


async def describe(*args: str) -> tuple[int, WorkerCard | None, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPENENGINE_SIDECAR_")}
    with trio.fail_after(30):
        done = await trio.run_process(
            [sys.executable, "-m", "sidecar", "describe", "--json", *args],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
            env=env,
        )
    card = json_decode(done.stdout, WorkerCard) if done.stdout else None
    return done.returncode, card, done.stderr.decode()


async def start(engine: RunningServer, **config: Any) -> WorkerCard:
    async with open_engine_client(engine.address) as client:
        sidecar = Sidecar(client, SidecarConfig(startup_deadline=5, **config))
        with trio.fail_after(10):
            return await sidecar.startup()


# --------------------------------------------------------------------------- finding 1: BSR releases


@pytest.mark.parametrize("release", [BSR, f"buf.build/openengine/openengine:{BSR}"])
async def test_bsr_release_is_served_described_and_expected(engine: RunningServer, release: str) -> None:
    advertise(engine, schema_revision=1, schema_release=release)
    code, card, err = await describe("--engine", engine.address)
    assert code == 0, err
    assert card is not None and card.schema.release_kind == "bsr" and card.schema.release == release
    code, card, err = await describe("--engine", engine.address, "--expected-schema-release", BSR)
    assert code == 0, err
    code, _, err = await describe("--engine", engine.address, "--expected-schema-release", "f" * 32)
    assert code == 1 and f"advertises {release}" in err
    assert (await start(engine, expected_release=BSR)).schema.release == release


# --------------------------------------------------------------------------- finding 2: untested releases


async def test_untested_release_is_served_with_one_warning(
    engine: RunningServer, caplog: pytest.LogCaptureFixture
) -> None:
    advertise(engine, schema_revision=1, schema_release=UNKNOWN)
    with caplog.at_level(logging.WARNING, logger="sidecar.core.sidecar"):
        card = await start(engine)
    assert card.compatibility is not None and card.compatibility.status == "untested"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and UNKNOWN in warnings[0] and "untested" in warnings[0]
    with pytest.raises(StartupError, match="--require-known-release refuses"):
        await start(engine, require_known_release=True)
    code, card, err = await describe("--engine", engine.address, "--require-known-release")
    assert code == 1 and "--require-known-release" in err


async def test_revision_one_names_two_schemas(
    engine: RunningServer, caplog: pytest.LogCaptureFixture
) -> None:
    """4def7c5 and 31be5db both advertise revision 1: the card tells them apart, both known."""
    advertise(engine, schema_revision=1, schema_release=B31)
    code, new, err = await describe("--engine", engine.address)
    assert code == 0, err
    info, models = vllm_info()
    legacy(info, models)
    info.schema_revision, info.schema_release = 1, DEF
    engine.engine.unary["GetServerInfo"] = lambda r: info
    engine.engine.unary["GetModelInfo"] = lambda r: models[next(iter(models))]
    code, old, err = await describe("--engine", engine.address)
    assert code == 0, err
    assert new is not None and old is not None
    assert new.compatibility is not None and old.compatibility is not None
    assert (new.schema.numbering, new.compatibility.known_release) == ("restarted", "31be5db")
    assert (old.schema.numbering, old.compatibility.known_release) == ("original", "4def7c5")
    assert (
        new.compatibility.features["drain"] is False and old.compatibility.features["handoffProfile"] is False
    )
    with caplog.at_level(logging.WARNING, logger="sidecar.core.sidecar"):
        await start(engine, require_known_release=True)
    assert not caplog.records  # a known release: no warning


# --------------------------------------------------------------------------- finding 3: legacy P/D engines


@pytest.mark.parametrize("role", [R.PREFILL, R.DECODE])
async def test_pd_engine_without_handoff_profile_is_served(
    engine: RunningServer, role: pb.EngineRole, caplog: pytest.LogCaptureFixture
) -> None:
    info = advertise(engine, role=role, schema_revision=1, schema_release=DEF)
    legacy(info)
    assert info.kv_connector is not None and info.kv_connector.transfer_backend == "nixl"
    code, card, err = await describe("--engine", engine.address)
    assert code == 0, err
    assert card is not None and card.kv_connector is not None
    assert card.kv_connector.handoff_profile == "vllm.kv_transfer_params.v1"
    assert card.kv_connector.handoff_profile_source == "derived"
    with caplog.at_level(logging.WARNING, logger="sidecar.core.sidecar"):
        await start(engine)
    assert [r.getMessage() for r in caplog.records if "derived vllm.kv_transfer_params.v1" in r.getMessage()]
    # nothing identifies the handoff: refused, unless the operator names it
    info.kv_connector.transfer_backend = "lmcache"
    with pytest.raises(StartupError, match="set --handoff-profile"):
        await start(engine)
    card = await start(engine, handoff_profile="vllm.kv_transfer_params.v1")
    assert card.kv_connector is not None and card.kv_connector.handoff_profile_source == "configured"
    code, _, err = await describe("--engine", engine.address, "--handoff-profile", "not a profile")
    assert code == 2 and "not a handoff profile name" in err


async def test_derived_decode_accepts_sessions_without_profile(engine: RunningServer) -> None:
    """A legacy prefill's PrefillReady session names no profile; a named one must still match."""
    info = advertise(engine, role=R.DECODE, schema_revision=1, schema_release=DEF)
    legacy(info)
    card = await start(engine)
    session = pb.KvSessionRef(session_id="s", transfer_backend="nixl", dp_rank=0)
    check_decode_session(session, card)
    session.handoff_profile = "tensorrt_llm.disaggregated_params.v1"
    with pytest.raises(Rejection, match="does not match"):
        check_decode_session(session, card)
    advertise(engine, role=R.DECODE)  # the same engine on a66ff6f: its sessions name the profile
    with pytest.raises(Rejection, match="no handoff_profile"):
        check_decode_session(pb.KvSessionRef(session_id="s", dp_rank=0), await start(engine))
