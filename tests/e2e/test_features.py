"""The rest of discovery end to end: media per flavour and role, routing metadata, LoRA, DP ranks, load.

Real mock-engine and sidecar processes; what the engine received is read from its ground truth
(``GetLoad.attributes``: counters and ``recent_requests``).
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from sidecar.client.sidecar_client import SidecarCallError, open_sidecar
from sidecar.openengine import pb
from tests.e2e.harness import (
    engine_counters,
    eventually,
    generate_request,
    mock_engine,
    sidecar,
    wait_engine_idle,
)

SIDECAR_ARGS = ("--no-kv-events",)
ROUTING = {"openengine-routing-key": "tenant-7/user-42:a=b"}


def item(modality: str, source: str, uuid: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {"modality": f"MODALITY_{modality.upper()}"}
    if source == "url":
        out["url"] = f"http://media.example/{modality}"
    elif source == "data_uri":
        mime = {"image": "image/png", "video": "video/mp4", "audio": "audio/wav"}[modality]
        out["dataUri"] = f"data:{mime};base64,AAAA"
    else:
        out["rawBytes"] = base64.b64encode(b"\x01\x02\x03").decode()
    if uuid:
        out["uuid"] = uuid
    return out


def received(entry: dict[str, Any]) -> list[dict[str, str]]:
    return [{"modality": m["modality"], "source": m["source"], "uuid": m["uuid"]} for m in entry["media"]]


def expected(items: list[dict[str, Any]]) -> list[dict[str, str]]:
    names = {"url": "url", "dataUri": "data_uri", "rawBytes": "raw_bytes"}
    return [
        {
            "modality": i["modality"],
            "source": next(names[k] for k in names if k in i),
            "uuid": i.get("uuid", ""),
        }
        for i in items
    ]


async def run(url: str, request: dict[str, Any], metadata: Any = None, kv: bytes | None = None) -> Any:
    async with open_sidecar(url) as client, client.generate(request, metadata, kv_session_bytes=kv) as stream:
        events = [e async for e in stream]
    assert stream.end is not None
    return events, stream.end


async def recent(address: str) -> dict[str, Any]:
    out: dict[str, Any] = (await engine_counters(address))["recent_requests"]
    return out


# flavour -> (accepted on the aggregated path, refused there, accepted on the P/D path, refused there)
MEDIA = {
    "trtllm": (
        [item("video", "url", "v-1"), item("audio", "data_uri", "a-2"), item("image", "url", "i-3")],
        [item("image", "raw_bytes")],  # source type not advertised
        [item("video", "url", "v-1"), item("image", "data_uri", "i-2")],
        [item("image", "url"), item("audio", "url")],  # audio: aggregated only
    ),
    "vllm": (
        [item("image", "data_uri", "i-1"), item("image", "url", "i-2")],
        [item("video", "url")],  # vLLM takes no video here
        [item("image", "url", "i-1")],
        [item("video", "url")],
    ),
    "sglang": (
        [item("audio", "raw_bytes", "a-1"), item("video", "url", "v-2"), item("image", "data_uri", "i-3")],
        [],
        None,  # a bootstrap prefill only completes with its decode: see test_disagg.py
        [item("audio", "raw_bytes")],
    ),
}


@pytest.mark.parametrize("flavor", ["trtllm", "vllm", "sglang"])
async def test_media_matrix_routing_key_and_roles(aio_loop: Any, tmp_path: Path, flavor: str) -> None:
    agg_ok, agg_refused, pd_ok, pd_refused = MEDIA[flavor]
    with trio.fail_after(30):
        async with (
            mock_engine(tmp_path, "--flavor", flavor, name="agg") as ae,
            mock_engine(tmp_path, "--flavor", flavor, "--role", "prefill", name="pre") as pe,
            sidecar(ae.address, *SIDECAR_ARGS) as asc,
            sidecar(pe.address, *SIDECAR_ARGS) as psc,
        ):
            async with open_sidecar(asc.ws) as client:
                agg_card = await client.call("describe")
            async with open_sidecar(psc.ws) as client:
                pre_card = await client.call("describe")
            for card in (agg_card, pre_card):
                mm = card["models"][0]["multimodal"]
                assert mm["routingImageTokenId"] == 3
            assert pre_card["models"][0]["multimodal"]["prefillDecodeModalities"] != [
                "image",
                "video",
                "audio",
            ]

            # aggregated: accepted media arrive in order with their uuids; routing key unchanged
            events, end = await run(asc.ws, generate_request(max_tokens=2, media=agg_ok), ROUTING)
            assert end.outcome == "completed", end
            [entry] = (await recent(ae.address)).values()
            assert received(entry) == expected(agg_ok)
            assert entry["metadata"] == ROUTING

            # refusals never reach an engine
            bootstrap = None
            if pre_card["kvConnector"]["supportsClientBootstrap"]:
                ep = pre_card["kvConnector"]["bootstrapEndpoint"]
                bootstrap = bytes(
                    pb.KvSessionRef(
                        handoff_profile=pre_card["kvConnector"]["handoffProfile"],
                        bootstrap=pb.KvBootstrap(
                            endpoint=pb.KvEndpoint(host=ep["host"], port=ep["port"]), room_id=5
                        ),
                    )
                )
            refusals: list[tuple[str, dict[str, Any], bytes | None, str]] = [
                (asc.ws, generate_request(media=agg_refused), None, "UNSUPPORTED_FEATURE"),
                (psc.ws, generate_request(media=pd_refused), bootstrap, "UNSUPPORTED_FEATURE"),
                # a request shaped for another role
                (
                    asc.ws,
                    generate_request(),
                    bytes(pb.KvSessionRef(session_id="s", handoff_profile="x")),
                    "ROLE_MISMATCH",
                ),
            ]
            if bootstrap is None:
                refusals.append(
                    (psc.ws, generate_request(), bytes(pb.KvSessionRef(session_id="s")), "ROLE_MISMATCH")
                )
            else:
                refusals.append((psc.ws, generate_request(), None, "ROLE_MISMATCH"))
            for url, request, kv, code in refusals:
                if not request.get("media", True):
                    continue  # nothing to refuse on this path
                events, end = await run(url, request, kv=kv)
                assert events == [] and (end.outcome, end.error.code) == ("rejected", f"ERROR_CODE_{code}"), (
                    request,
                    end,
                )

            # the prefill/decode path of a context-first prefill
            if pd_ok is not None:
                events, end = await run(psc.ws, generate_request(max_tokens=1, media=pd_ok), ROUTING)
                assert end.outcome == "completed" and events[-1].response.prefill_ready is not None
                [entry] = (await recent(pe.address)).values()
                assert received(entry) == expected(pd_ok) and entry["metadata"] == ROUTING
            for engine, accepted in ((ae, 1), (pe, 0 if pd_ok is None else 1)):
                counters = await wait_engine_idle(engine.address)
                assert counters["requests_accepted"] == accepted and counters["requests_rejected"] == 0


@pytest.mark.parametrize(
    "engine_faults", [(), ("--fault", "lora-not-idempotent")], ids=["engine", "strict-engine"]
)
async def test_lora_lifecycle(aio_loop: Any, tmp_path: Path, engine_faults: tuple[str, ...]) -> None:
    """With ``strict-engine`` the engine answers a reload ALREADY_EXISTS: the sidecar still
    answers it as the idempotent success the schema defines."""
    root = tmp_path / "loras"
    (root / "sql").mkdir(parents=True)
    (root / "chat").mkdir()
    outside = tmp_path / "elsewhere" / "sql"
    outside.mkdir(parents=True)
    sql = {"loraId": "3", "loraName": "sql", "sourcePath": str(root / "sql")}
    with trio.fail_after(30):
        async with (
            mock_engine(tmp_path, "--flavor", "vllm", *engine_faults) as engine,
            sidecar(engine.address, *SIDECAR_ARGS, "--lora-root", str(root)) as sc,
            open_sidecar(sc.ws) as client,
        ):
            assert (await client.call("listLoras")).get("adapters", []) == []
            for request in (generate_request(model="sql"), generate_request(loraName="sql")):
                _, end = await run(sc.ws, request)
                assert (end.outcome, end.error.code) == ("rejected", "ERROR_CODE_MODEL_NOT_FOUND")

            # the schema's rules (and --lora-root) are checked before the engine
            bad = [
                ("loadLora", {"adapter": {**sql, "loraId": "0"}}, "loraId"),
                ("loadLora", {"adapter": {**sql, "loraName": ""}}, "loraName"),
                ("loadLora", {"adapter": {**sql, "sourcePath": "loras/sql"}}, "absolute"),
                ("loadLora", {"adapter": {**sql, "sourcePath": f"{root}/chat/../sql"}}, "normalized"),
                ("loadLora", {"adapter": {**sql, "sourcePath": str(outside)}}, "LoRA root"),
                ("loadLora", {"adapter": {**sql, "sourcePath": str(root)}}, "LoRA root"),
                ("loadLora", {}, "adapter is required"),
                ("unloadLora", {"loraName": ""}, "loraName"),
            ]
            for method, params, fragment in bad:
                with pytest.raises(SidecarCallError) as info:
                    await client.call(method, params)
                assert info.value.code == "ERROR_CODE_INVALID_ARGUMENT", (params, info.value)
                assert fragment in info.value.message and "engine answered" not in info.value.message

            loaded = await client.call("loadLora", {"adapter": sql})
            assert loaded["adapter"]["loraName"] == "sql" and not loaded.get("alreadyLoaded", False)
            again = await client.call("loadLora", {"adapter": sql})
            assert again["alreadyLoaded"] is True  # idempotent
            with pytest.raises(SidecarCallError) as info:  # same name, another path: the engine's conflict
                await client.call("loadLora", {"adapter": {**sql, "sourcePath": str(root / "chat")}})
            assert info.value.code == "ERROR_CODE_INVALID_ARGUMENT" and "ALREADY_EXISTS" in info.value.message

            card = await client.call("describe")
            assert "sql" in card["servedModelNames"]
            assert [a["loraName"] for a in card["loraAdapters"]] == ["sql"]
            assert [a["loraName"] for a in (await client.call("listLoras"))["adapters"]] == ["sql"]
            for request in (
                generate_request(model="sql", max_tokens=2),
                generate_request(loraName="sql", max_tokens=2),
            ):
                _, end = await run(sc.ws, request)
                assert end.outcome == "completed", end
            for entry in (await recent(engine.address)).values():
                assert (entry["model"], entry["lora_name"]) == ("Qwen/Qwen3-0.6B", "sql")

            await client.call("unloadLora", {"loraName": "sql"})
            card = await client.call("describe")
            assert "sql" not in card["servedModelNames"] and card["loraAdapters"] == []
            _, end = await run(sc.ws, generate_request(model="sql"))
            assert (end.outcome, end.error.code) == ("rejected", "ERROR_CODE_MODEL_NOT_FOUND")
            with pytest.raises(SidecarCallError) as info:
                await client.call("unloadLora", {"loraName": "sql"})
            assert (
                info.value.code == "ERROR_CODE_MODEL_NOT_FOUND"
                and "engine answered NOT_FOUND" in info.value.message
            )
            counters = await wait_engine_idle(engine.address)
            assert counters["requests_accepted"] == 2 and counters["requests_rejected"] == 0


async def http_get(url: str) -> httpx.Response:
    async with httpx.AsyncClient() as client:
        return await client.get(url, timeout=5)


async def test_dp_ranks_routing_and_load(aio_loop: Any, tmp_path: Path) -> None:
    with trio.fail_after(30):
        async with (
            mock_engine(tmp_path, "--flavor", "vllm", "--dp-size", "2", "--no-lora") as engine,
            sidecar(engine.address, *SIDECAR_ARGS, "--load-interval", "0.1") as sc,
            open_sidecar(sc.ws) as client,
        ):
            card = await client.call("describe")
            assert card["dpRanks"] == [0, 1] and card["parallelism"]["dataParallelSize"] == 2
            with pytest.raises(SidecarCallError) as info:  # the card says no LoRA: refused before the engine
                await client.call(
                    "loadLora", {"adapter": {"loraId": "1", "loraName": "a", "sourcePath": "/a"}}
                )
            assert info.value.code == "ERROR_CODE_UNSUPPORTED_FEATURE"

            # requests with a target land on that rank
            for rank in ("1", "1", "001", "0"):
                _, end = await run(sc.ws, generate_request(max_tokens=2), {"openengine-target-dp-rank": rank})
                assert end.outcome == "completed", end
            for rank in ("2", "-1", "x", "4294967296", ""):
                events, end = await run(sc.ws, generate_request(), {"openengine-target-dp-rank": rank})
                assert events == [] and (end.outcome, end.error.code) == (
                    "rejected",
                    "ERROR_CODE_INVALID_ARGUMENT",
                )
            counters = await wait_engine_idle(engine.address)
            assert counters["served_by_rank"] == {"0": 1, "1": 3}
            assert counters["requests_accepted"] == 4 and counters["requests_rejected"] == 0
            targets = [
                e["metadata"]["openengine-target-dp-rank"] for e in counters["recent_requests"].values()
            ]
            assert targets == ["1", "1", "1", "0"]  # canonical form forwarded
            assert [e["rank"] for e in counters["recent_requests"].values()] == [1, 1, 1, 0]

            # load: per-rank snapshot polled every interval, Prometheus gauges per rank
            stalled = generate_request(max_tokens=50, extra={"mock": {"faults": ["stall=1"]}})
            async with client.generate(stalled, {"openengine-target-dp-rank": "1"}) as stream:

                async def rank1_busy() -> Any:
                    load = (await http_get(sc.http + "/v1/load")).json()
                    ranks = load["snapshot"]["ranks"] if load["snapshot"] else []
                    return load if [r["runningRequests"] for r in ranks] == [0, 1] else None

                load = await eventually(rank1_busy)
                assert load["stale"] is False and load["ageS"] < 1 and load["errorCount"] == 0
                assert [r["dataParallelRank"] for r in load["snapshot"]["ranks"]] == [0, 1]
                metrics = (await http_get(sc.http + "/metrics")).text
                assert 'openengine_engine_running_requests{rank="1"} 1.0' in metrics
                assert 'openengine_engine_running_requests{rank="0"} 0.0' in metrics
                assert 'openengine_engine_kv_blocks_total{rank="0"} 4096.0' in metrics
                async for _ in stream:
                    break
            ages = []
            for _ in range(3):  # the snapshot keeps being refreshed: its age stays below a few intervals
                ages.append((await client.call("load"))["ageS"])
                await trio.sleep(0.15)
            assert max(ages) < 0.5

            # GetLoad failing: errors counted, the snapshot flagged stale at once, gauges withdrawn
            engine.proc.process.kill()

            async def failing_load(errors: int) -> Any:
                load = (await http_get(sc.http + "/v1/load")).json()
                return load if load["consecutiveErrors"] >= errors else None

            load = await eventually(lambda: failing_load(1))
            assert load["stale"] is True  # from the first failed poll, not only once it is old
            load = await eventually(lambda: failing_load(2))  # polling goes on
            assert load["errorCount"] >= 2 and load["lastError"]
            assert load["snapshot"]["ranks"]  # the last snapshot is still shown, flagged stale
            worker = (await http_get(sc.http + "/v1/worker")).json()
            assert worker["load"]["stale"] is True and worker["load"]["errorCount"] >= 2
            metrics = (await http_get(sc.http + "/metrics")).text
            assert "openengine_engine_running_requests{" not in metrics
            errors = [
                ln
                for ln in metrics.splitlines()
                if ln.startswith("openengine_sidecar_load_poll_errors_total")
            ]
            assert errors and float(errors[0].split()[-1]) >= 2
