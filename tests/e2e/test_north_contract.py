"""The north contract as documented in docs/PROTOCOL.md, end to end (real mock-engine and
sidecar processes, real WebSocket and HTTP): 64-bit integers as decimal strings in every
answer, ``health`` / ``load`` params honoured or refused, LoRA calls refused locally when the
worker has no LoRA, the ``engineState`` vocabulary."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from sidecar.client.sidecar_client import open_sidecar
from tests.e2e.harness import eventually, mock_engine, sidecar

pytestmark = pytest.mark.slow

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
