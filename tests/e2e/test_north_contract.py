"""The north contract as documented in docs/PROTOCOL.md, end to end (real mock-engine and
sidecar processes, real WebSocket and HTTP): 64-bit integers as decimal strings in every
answer, ``health`` / ``load`` params honoured or refused, LoRA calls refused locally when the
worker has no LoRA, the ``engineState`` vocabulary, the metadata rules."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from sidecar.client.sidecar_client import SidecarCallError, open_sidecar
from tests.e2e.harness import engine_counters, eventually, generate_request, mock_engine, sidecar

SIDECAR_ARGS = ("--no-kv-events", "--load-interval", "0.1")


async def http_json(url: str) -> Any:
    async with httpx.AsyncClient() as client:
        response = await client.get(url, timeout=5)
    assert response.status_code == 200, response.text
    return response.json()


def assert_u64(value: Any, where: str) -> None:
    assert isinstance(value, str) and value.isdigit(), f"{where}: {value!r} is not a decimal string"


def check_card(card: dict[str, Any], where: str) -> None:
    cap = card["capacity"]
    for name in ("totalKvBlocks", "maxRunningRequests", "maxBatchedTokens"):
        assert_u64(cap[name], f"{where} capacity.{name}")
    assert isinstance(cap["kvBlockSize"], int)  # 32-bit: a number
    assert card["loraAdapters"], where
    for adapter in card["loraAdapters"]:
        assert_u64(adapter["loraId"], f"{where} loraAdapters[].loraId")
    check_load(card["load"], f"{where} load")


def check_load(load: dict[str, Any], where: str, *, ranks: bool = True) -> None:
    snap = load["snapshot"]
    for name in ("timestampUnixNanos", "usedKvBlocks", "totalKvBlocks", "runningTokens", "waitingTokens"):
        assert_u64(snap[name], f"{where} snapshot.{name}")
    assert int(snap["timestampUnixNanos"]) > 2**53  # exact: a JSON number would have lost digits
    assert isinstance(snap["runningRequests"], int)
    if ranks:
        assert len(snap["ranks"]) == 2, where
        for rank in snap["ranks"]:
            assert_u64(rank["usedKvBlocks"], f"{where} ranks[].usedKvBlocks")
            assert_u64(rank["totalKvBlocks"], f"{where} ranks[].totalKvBlocks")


async def test_64_bit_integers_are_decimal_strings_in_every_answer(aio_loop: Any, tmp_path: Path) -> None:
    """docs/PROTOCOL.md: int64 / uint64 are decimal strings (proto3 JSON), in JSON and msgpack,
    in call results (describe, load, loadLora), the card at /v1/worker and the load at /v1/load."""
    lora = tmp_path / "loras" / "sql"
    lora.mkdir(parents=True)
    adapter = {"loraId": str(2**62 + 1), "loraName": "sql", "sourcePath": str(lora)}
    with trio.fail_after(60):
        async with (
            mock_engine(tmp_path, "--flavor", "vllm", "--dp-size", "2") as engine,
            sidecar(engine.address, *SIDECAR_ARGS) as sc,
        ):
            await eventually(lambda: _has_snapshot(sc.http))
            for encoding in ("json", "msgpack"):
                async with open_sidecar(sc.ws, encoding=encoding) as client:
                    loaded = await client.call("loadLora", {"adapter": adapter})
                    assert loaded["adapter"]["loraId"] == str(2**62 + 1), encoding
                    card = await client.call("describe")
                    check_card(card, f"describe ({encoding})")
                    assert {a["loraId"] for a in card["loraAdapters"]} == {str(2**62 + 1)}
                    check_load(await client.call("load", {"includePerRank": True}), f"load ({encoding})")
            check_card(await http_json(sc.http + "/v1/worker"), "GET /v1/worker")
            check_load(await http_json(sc.http + "/v1/load"), "GET /v1/load")


async def _has_snapshot(http: str) -> bool:
    return (await http_json(http + "/v1/load"))["snapshot"] is not None


async def call_error(client: Any, method: str, params: dict[str, Any]) -> SidecarCallError:
    with pytest.raises(SidecarCallError) as info:
        await client.call(method, params)
    return info.value


async def test_health_and_load_params_are_honoured_or_refused(aio_loop: Any, tmp_path: Path) -> None:
    """``health`` with HealthRequest fields asks the engine (model checked against the card first,
    forwarded as the served name) and reports its answer; ``load`` shows per-rank rows only when
    ``includePerRank`` asks for them. ``engineState`` takes one vocabulary."""
    with trio.fail_after(60):
        async with (
            mock_engine(tmp_path, "--flavor", "vllm", "--dp-size", "2", "--alias", "qwen") as engine,
            sidecar(engine.address, *SIDECAR_ARGS) as sc,
            open_sidecar(sc.ws) as client,
        ):
            health = await client.call("health")
            assert health == {
                "ready": True,
                "reason": None,
                "draining": False,
                "engineState": "ready",
                "activeStreams": 0,
            }  # no engine section: nothing was asked of the engine
            err = await call_error(
                client, "health", {"model": "no-such-model", "includeInferenceProbe": True}
            )
            assert err.code == "ERROR_CODE_MODEL_NOT_FOUND" and "no-such-model" in err.message

            for params in ({"includeInferenceProbe": True}, {"model": "qwen", "includeInferenceProbe": True}):
                health = await client.call("health", params)
                assert health["ready"] is True and health["engineState"] == "ready", params
                assert health["engine"]["state"] == "ready"
                checks = {c["name"]: c for c in health["engine"]["checks"]}
                # the probe ran, on the served model (the alias was resolved before forwarding)
                assert checks["inference_probe"]["state"] == "ready", checks
                assert checks["inference_probe"]["message"].startswith("generated token")

            # asked whether it serves the decode role, the aggregated engine says no
            health = await client.call("health", {"role": "ENGINE_ROLE_DECODE"})
            assert (health["ready"], health["engineState"], health["engine"]["state"]) == (
                False,
                "not_ready",
                "not_ready",
            )
            assert health["reason"] == "engine health is not_ready (role: engine role is aggregated)"
            assert (await client.call("health"))["ready"] is True  # the sidecar's own view is unchanged

            await eventually(lambda: _has_snapshot(sc.http))
            assert (await client.call("load"))["snapshot"]["ranks"] == []
            assert (await client.call("load", {"includePerRank": False}))["snapshot"]["ranks"] == []
            ranks = (await client.call("load", {"includePerRank": True}))["snapshot"]["ranks"]
            assert [r["dataParallelRank"] for r in ranks] == [0, 1]

            # engine gone: the last check's view says so; asking the engine is a typed, retryable error
            engine.proc.process.kill()

            async def unreachable() -> Any:
                health = await client.call("health")
                return health if health["engineState"] == "unreachable" else None

            health = await eventually(unreachable)
            assert health["ready"] is False and health["reason"].startswith("engine unreachable")
            err = await call_error(client, "health", {"includeInferenceProbe": True})
            assert err.code == "ERROR_CODE_INTERNAL" and err.retryable


async def test_lora_calls_are_refused_locally_without_lora(aio_loop: Any, tmp_path: Path) -> None:
    """An engine whose models do not support LoRA: listLoras, loadLora and unloadLora are refused
    by the sidecar with a typed UNSUPPORTED_FEATURE before the engine (listLoras was forwarded
    and answered with the engine's gRPC status text)."""
    with trio.fail_after(60):
        async with (
            mock_engine(tmp_path, "--flavor", "vllm", "--no-lora") as engine,
            sidecar(engine.address, *SIDECAR_ARGS) as sc,
            open_sidecar(sc.ws) as client,
        ):
            calls = [
                ("listLoras", {}),
                ("loadLora", {"adapter": {"loraId": "1", "loraName": "a", "sourcePath": "/a"}}),
                ("unloadLora", {"loraName": "a"}),
            ]
            for method, params in calls:
                err = await call_error(client, method, params)
                assert (err.code, err.message) == (
                    "ERROR_CODE_UNSUPPORTED_FEATURE",
                    "this worker's models do not support LoRA",
                ), method  # the sidecar's own refusal ("engine answered ..." when forwarded)


TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


async def test_metadata_rules_as_documented(aio_loop: Any, tmp_path: Path) -> None:
    """docs/PROTOCOL.md "Metadata": openengine-priority needs a model advertising it
    (UNSUPPORTED_FEATURE otherwise: TensorRT-LLM's does not); tracestate only with a
    traceparent; trace context and canonical numbers reach the engine as documented."""
    async with (
        mock_engine(tmp_path, "--flavor", "trtllm") as trt,
        sidecar(trt.address, *SIDECAR_ARGS) as trt_sc,
        mock_engine(tmp_path, "--flavor", "vllm", name="vllm") as vllm,
        sidecar(vllm.address, *SIDECAR_ARGS) as vllm_sc,
    ):
        with trio.fail_after(60):
            refused = [
                (trt_sc, {"openengine-priority": "5"}, "ERROR_CODE_UNSUPPORTED_FEATURE"),
                (vllm_sc, {"tracestate": "congo=t61rcWkgMzE"}, "ERROR_CODE_INVALID_ARGUMENT"),
                (
                    vllm_sc,
                    {"traceparent": TRACEPARENT, "tracestate": "a=1,a=2"},
                    "ERROR_CODE_INVALID_ARGUMENT",
                ),
                (vllm_sc, {"traceparent": "ff" + TRACEPARENT[2:]}, "ERROR_CODE_INVALID_ARGUMENT"),
                (vllm_sc, {"openengine-priority": "2147483648"}, "ERROR_CODE_INVALID_ARGUMENT"),
            ]
            for sc, metadata, code in refused:
                async with open_sidecar(sc.ws) as client, client.generate(generate_request(), metadata) as s:
                    assert [e async for e in s] == []
                assert s.end is not None and (s.end.outcome, s.end.error.code) == ("rejected", code), metadata
            metadata = {
                "openengine-priority": "-007",
                "Traceparent": TRACEPARENT,
                "tracestate": "congo=t61rcWkgMzE, rojo=00f067aa0ba902b7",
                "x-app": "v",
            }
            async with open_sidecar(vllm_sc.ws) as client, client.generate(generate_request(), metadata) as s:
                async for _ in s:
                    pass
            assert s.end is not None and s.end.outcome == "completed", s.end
            [entry] = (await engine_counters(vllm.address))["recent_requests"].values()
            assert entry["metadata"] == {  # what the engine records of the OpenEngine keys
                "openengine-priority": "-7",
                "traceparent": TRACEPARENT,
                "tracestate": "congo=t61rcWkgMzE, rojo=00f067aa0ba902b7",
            }
