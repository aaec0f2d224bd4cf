"""``describe``: the readable form, and discovery over a real gRPC socket (scriptable fake engine)."""

from __future__ import annotations

import os
import re
import sys
from collections.abc import AsyncIterator
from typing import Any

import pytest
import trio

from sidecar.core.card import card_from_json
from sidecar.core.describe_command import DescribeFailed, describe_engine, format_card
from sidecar.openengine import pb
from tests.openengine.fake_grpc_engine import FakeGrpcEngine, Gate, RunningServer, Status, status

from .shapes import R, sglang_card, sglang_info, trtllm_card, vllm_card, vllm_info


def test_format_vllm() -> None:
    text = format_card(vllm_card(dp=2))
    assert "Engine        vllm 0.26.1 (instance vllm-1)" in text
    assert "Role          aggregated" in text
    assert "DP ranks 0, 1" in text
    assert "Model         llama (aliases: meta-llama/Llama-3.1-8B-Instruct)" in text
    assert "output logprobs   yes (modes: top_n, token_ids, max top-n: 20)" in text
    assert "prefix-cache bypass no" in text
    assert "routing image token 32000" in text
    assert "LoRA adapter  sql-lora (id 1) /adapters/sql on llama" in text
    assert "KV events     unknown" in text
    assert "PROBLEM" not in text


def test_format_unknowns() -> None:
    text = format_card(sglang_card(R.DECODE))
    assert "generation        unknown" in text
    assert "multimodal        unknown (no capabilities reported)" in text
    assert "LoRA adapters unknown" in text
    assert "Capacity      unknown" in text
    assert "client bootstrap yes" in text
    t = format_card(trtllm_card())
    assert "prompt logprobs   no" in t
    assert "priority unknown" in t
    assert "aggregated: image, audio; prefill/decode: image" in t
    assert "LoRA adapters none" in t


def test_format_problems() -> None:
    info, models = sglang_info(R.DECODE)
    info.kv_connector = None
    from .shapes import card_of

    assert "PROBLEM       decode engine advertises no enabled KV connector" in format_card(
        card_of((info, models), loras=None)
    )


def _raise(code: Status) -> Any:
    def handler(request: Any) -> Any:
        raise status(code, "not here")

    return handler


@pytest.fixture
async def engine(aio_loop: Any) -> AsyncIterator[RunningServer]:
    fake = FakeGrpcEngine()
    info, models = vllm_info(dp=2)
    fake.unary["GetServerInfo"] = lambda r: info
    fake.unary["GetModelInfo"] = lambda r: (
        models[r.model] if r.model in models else _raise(Status.NOT_FOUND)(r)
    )
    fake.unary["GetKvEventSources"] = _raise(Status.UNIMPLEMENTED)
    fake.unary["ListLoras"] = lambda r: pb.ListLorasResponse(
        adapters=[pb.LoraAdapter(lora_id=1, lora_name="sql-lora", source_path="/adapters/sql")]
    )
    server = RunningServer(fake)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


async def test_describe_engine_over_grpc(engine: RunningServer) -> None:
    with trio.fail_after(10):
        card = await describe_engine(engine.address)
    expected = vllm_card(dp=2)
    assert card == expected
    routes = [s.route for s in engine.engine.seen]
    assert routes == ["GetServerInfo", "GetModelInfo", "GetKvEventSources", "ListLoras"]


async def test_describe_engine_negotiation_failure(engine: RunningServer) -> None:
    info, _ = vllm_info()
    info.schema_revision = 0
    engine.engine.unary["GetServerInfo"] = lambda r: info
    with (
        trio.fail_after(10),
        pytest.raises(DescribeFailed, match=r"negotiation with .* failed: vllm advertises"),
    ):
        await describe_engine(engine.address)
    with trio.fail_after(10), pytest.raises(DescribeFailed, match="expected engine 'sglang'"):
        info.schema_revision = 3
        await describe_engine(engine.address, expected_engine="sglang")


async def test_describe_engine_model_info_failure(engine: RunningServer) -> None:
    engine.engine.unary["GetModelInfo"] = _raise(Status.INTERNAL)
    with trio.fail_after(10), pytest.raises(DescribeFailed, match=r"GetModelInfo\('llama'\) failed"):
        await describe_engine(engine.address)


async def test_describe_engine_connect_timeout(engine: RunningServer) -> None:
    engine.engine.unary["GetServerInfo"] = lambda r: Gate()  # never opened
    with trio.fail_after(10), pytest.raises(DescribeFailed, match=re.escape("did not answer within 0.2 s")):
        await describe_engine(engine.address, connect_timeout=0.2)


async def test_describe_engine_unreachable(aio_loop: Any, tmp_path: Any) -> None:
    with trio.fail_after(10), pytest.raises(DescribeFailed, match="unreachable"):
        await describe_engine(f"unix://{tmp_path}/nothing.sock")
    with trio.fail_after(10), pytest.raises(DescribeFailed, match="invalid engine address"):
        await describe_engine("not an address")


async def _cli(*args: str) -> trio.CompletedProcess[bytes]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env = {k: v for k, v in env.items() if not k.startswith("OPENENGINE_SIDECAR_")}
    with trio.fail_after(30):
        return await trio.run_process(
            [sys.executable, "-m", "sidecar", "describe", *args],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
            env=env,
        )


async def test_cli_json_and_table(engine: RunningServer) -> None:
    done = await _cli("--engine", engine.address, "--json")
    assert done.returncode == 0, done.stderr
    card = card_from_json(done.stdout)
    assert card == vllm_card(dp=2)
    done = await _cli("--engine", engine.address, "--model", "meta-llama/Llama-3.1-8B-Instruct")
    assert done.returncode == 0, done.stderr
    assert b"Model         llama" in done.stdout


async def test_cli_failures(engine: RunningServer) -> None:
    info, _ = vllm_info()
    info.schema_release = "main"
    engine.engine.unary["GetServerInfo"] = lambda r: info
    done = await _cli("--engine", engine.address)
    assert done.returncode == 1
    assert done.stdout == b""
    err = done.stderr.decode().strip()
    assert "\n" not in err
    assert (
        err.startswith("openengine-sidecar: negotiation with")
        and "'main', not an immutable schema release" in err
    )
    # problems: the card is printed, the reason goes to stderr, exit 1
    info2, _ = vllm_info(R.DECODE)
    info2.kv_connector = None
    engine.engine.unary["GetServerInfo"] = lambda r: info2
    done = await _cli("--engine", engine.address, "--json")
    assert done.returncode == 1
    assert card_from_json(done.stdout).problems
    assert b"would not serve this engine" in done.stderr
    done = await _cli("--engine", engine.address, "--expected-schema-release", "main")
    assert done.returncode == 2 and b"not an immutable schema release" in done.stderr
