"""Prefill/decode disaggregation end to end: mock engines, sidecars and the coordinator, all real.

What the engines received is read from their ground truth (``GetLoad.attributes``:
``recent_requests`` holds each request's KvSessionRef bytes exactly as they came off the wire).
"""

from __future__ import annotations

import base64
import json
import socket
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio

from sidecar.client.disagg import open_disagg
from sidecar.client.sidecar_client import SidecarCallError, open_sidecar
from sidecar.openengine import pb
from tests.e2e.harness import (
    Engine,
    Sidecar,
    engine_counters,
    eventually,
    generate_request,
    mock_engine,
    sidecar,
    wait_engine_idle,
)

#: Sidecars here do not bridge KV events (not under test; faster to start).
SIDECAR_ARGS = ("--no-kv-events",)
PROMPT = " ba be bi" * 6  # 19 tokens: two KV blocks of 16, one partial
ROUTING = {"openengine-routing-key": "tenant-7/user-42"}
FIELD_99 = b"\x9a\x06\x05extra"  # field 99, length-delimited: unknown to every schema revision


@dataclass
class PD:
    prefill: Engine
    decode: Engine
    prefill_sc: Sidecar
    decode_sc: Sidecar


@asynccontextmanager
async def pd_stack(
    tmp_path: Path, flavor: str, *, prefill_args: tuple[str, ...] = (), decode_args: tuple[str, ...] = ()
) -> AsyncIterator[PD]:
    async with (
        mock_engine(tmp_path, "--flavor", flavor, "--role", "prefill", *prefill_args, name="prefill") as pe,
        mock_engine(tmp_path, "--flavor", flavor, "--role", "decode", *decode_args, name="decode") as de,
        sidecar(pe.address, *SIDECAR_ARGS) as ps,
        sidecar(de.address, *SIDECAR_ARGS) as ds,
    ):
        yield PD(pe, de, ps, ds)


async def recent(address: str) -> dict[str, Any]:
    counters = await engine_counters(address)
    out: dict[str, Any] = counters["recent_requests"]
    return out


async def session_received(address: str) -> list[bytes]:
    """The KvSessionRef bytes each recent request carried to the engine, in arrival order."""
    return [
        base64.b64decode(r["kv_session_b64"])
        for r in (await recent(address)).values()
        if "kv_session_b64" in r
    ]


async def idle_and_clean(address: str) -> dict[str, Any]:
    counters = await wait_engine_idle(address)
    assert counters["requests_leaked"] == 0 and counters["kv_sessions_open"] == 0, counters
    return counters


def token_ids(events: list[Any]) -> list[int]:
    return [t.token_id for e in events if e.response.token is not None for t in e.response.token.tokens]


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"ws://127.0.0.1:{port}"


@pytest.mark.parametrize("flavor", ["vllm", "trtllm", "sglang"])
async def test_aggregated_and_pd_serving(aio_loop: Any, tmp_path: Path, flavor: str) -> None:
    """P/D output equals the aggregated worker's; the handoff reaches the engines byte for byte."""
    request = generate_request(PROMPT, max_tokens=6)
    with trio.fail_after(30):
        async with (
            mock_engine(tmp_path, "--flavor", flavor, name="agg") as ae,
            sidecar(ae.address, *SIDECAR_ARGS) as asc,
            pd_stack(tmp_path, flavor) as pd,
        ):
            async with open_sidecar(asc.ws) as client, client.generate(request) as ref:
                reference = [e async for e in ref]
            assert ref.end is not None and ref.end.outcome == "completed"

            async with open_disagg([pd.prefill_sc.ws], [pd.decode_sc.ws]) as coordinator:
                async with coordinator.generate(request, ROUTING) as flow:
                    events = [e async for e in flow]
            flow.check()
            assert token_ids(events) == token_ids(reference) and len(token_ids(events)) == 6
            for engine in (pd.prefill, pd.decode):  # routing metadata reaches both engines unchanged
                assert [r["metadata"] for r in (await recent(engine.address)).values()] == [ROUTING]
            assert events[-1].response.usage.prompt_tokens == reference[-1].response.usage.prompt_tokens
            ready = flow.prefill_events[-1]
            assert ready.response.prefill_ready is not None and ready.kv_session_bytes is not None
            assert ready.response.usage.completion_tokens == 0
            received = {"prefill": await session_received(pd.prefill.address)}
            received["decode"] = await session_received(pd.decode.address)
            if flavor == "sglang":
                assert flow.mode == "bootstrap"
                room = int(flow.end.room)
                assert 0 < room < 2**63
                # the same client-made bootstrap reached both engines, and the prefill echoed it
                assert received == {"prefill": [flow.kv_session_bytes], "decode": [flow.kv_session_bytes]}
                echoed = ready.response.prefill_ready.kv_session["bootstrap"]
                assert int(echoed["roomId"]) == room
                sent = pb.KvSessionRef.parse(flow.kv_session_bytes)
                assert sent.bootstrap is not None and sent.bootstrap.endpoint is not None
                card = await _describe(pd.prefill_sc.ws)
                assert card["kvConnector"]["bootstrapEndpoint"]["port"] == sent.bootstrap.endpoint.port
            else:
                assert flow.mode == "context_first"
                # the prefill's KvSessionRef, relayed by both sidecars, reached the decode engine unchanged
                assert received == {"prefill": [], "decode": [ready.kv_session_bytes]}
                assert flow.kv_session_bytes == ready.kv_session_bytes
                [pre] = [r for r in (await recent(pd.prefill.address)).values()]
                assert pre["outcome"] == "completed"
            for engine in (pd.prefill, pd.decode, ae):
                await idle_and_clean(engine.address)


async def _describe(url: str) -> dict[str, Any]:
    async with open_sidecar(url) as client:
        card: dict[str, Any] = await client.call("describe")
    return card


async def test_kv_session_bytes_unknown_field_reaches_the_decode_engine(
    aio_loop: Any, tmp_path: Path
) -> None:
    """A newer schema's field in kvSessionBytes travels client → decode sidecar → engine untouched."""
    request = generate_request(PROMPT, max_tokens=4)
    with trio.fail_after(20):
        async with pd_stack(tmp_path, "vllm") as pd:
            async with open_sidecar(pd.prefill_sc.ws) as client:
                async with client.generate({**request, "stopping": {"maxTokens": 1}}) as stream:
                    [ready] = [e async for e in stream]
            assert stream.end is not None and stream.end.outcome == "completed"
            original = stream.kv_session_bytes
            assert original is not None and ready.kv_session_bytes == original
            # a newer schema's field, placed first: re-serializing a parsed copy would move it
            # to the end, so only a byte-for-byte relay passes
            newer = FIELD_99 + original
            assert bytes(pb.KvSessionRef.parse(newer)) == original + FIELD_99 != newer
            async with open_sidecar(pd.decode_sc.ws, encoding="msgpack") as client:
                async with client.generate(request, kv_session_bytes=newer) as stream:
                    events = [e async for e in stream]
            assert stream.end is not None and stream.end.outcome == "completed", stream.end
            assert len(token_ids(events)) == 4
            assert await session_received(pd.decode.address) == [newer]
            await idle_and_clean(pd.prefill.address)
            await idle_and_clean(pd.decode.address)


def _session(**fields: Any) -> bytes:
    base: dict[str, Any] = {
        "session_id": "s-1",
        "transfer_backend": "nixl",
        "handoff_profile": "vllm.kv_transfer_params.v1",
        "endpoints": [pb.KvEndpoint(host="127.0.0.1", port=1, protocol="tcp")],
        "attributes_struct": pb.Struct.from_dict({"remote_block_ids": [1, 2]}),
    }
    return bytes(pb.KvSessionRef(**{**base, **fields}))


BOOTSTRAP = pb.KvBootstrap(endpoint=pb.KvEndpoint(host="127.0.0.1", port=5, protocol="tcp"), room_id=9)
DECODE_REJECTIONS: list[tuple[str, bytes | None, dict[str, str] | None, dict[str, Any], str]] = [
    (
        "vllm",
        _session(handoff_profile="tensorrt_llm.disaggregated_params.v1"),
        None,
        {},
        "UNSUPPORTED_FEATURE",
    ),
    ("vllm", _session(transfer_backend="ucx"), None, {}, "UNSUPPORTED_FEATURE"),
    ("vllm", _session(dp_rank=2), None, {}, "INVALID_ARGUMENT"),
    ("vllm", _session(dp_rank=0), {"openengine-target-dp-rank": "1"}, {}, "INVALID_ARGUMENT"),
    ("vllm", _session(bootstrap=BOOTSTRAP), None, {}, "INVALID_ARGUMENT"),
    ("vllm", _session(handoff_profile=""), None, {}, "INVALID_ARGUMENT"),
    ("vllm", b"\x0a\x05abc", None, {}, "INVALID_ARGUMENT"),  # truncated
    ("vllm", None, None, {}, "ROLE_MISMATCH"),  # a decode worker needs the handoff
    ("vllm", _session(), None, {"kv": {"session": {"sessionId": "x"}}}, "INVALID_ARGUMENT"),  # both forms
    (
        "sglang",
        _session(handoff_profile="sglang.bootstrap.v1", transfer_backend=""),
        None,
        {},
        "INVALID_ARGUMENT",
    ),
    (
        "sglang",
        _session(
            handoff_profile="sglang.bootstrap.v1",
            transfer_backend="mooncake",
            bootstrap=pb.KvBootstrap(endpoint=BOOTSTRAP.endpoint, room_id=0),
        ),
        None,
        {},
        "INVALID_ARGUMENT",
    ),
]


async def test_decode_envelope_checks_reject_before_the_engine(aio_loop: Any, tmp_path: Path) -> None:
    with trio.fail_after(30):
        async with (
            mock_engine(tmp_path, "--flavor", "vllm", "--role", "decode", "--dp-size", "2", name="v") as ve,
            mock_engine(tmp_path, "--flavor", "sglang", "--role", "decode", name="s") as se,
            sidecar(ve.address, *SIDECAR_ARGS) as vsc,
            sidecar(se.address, *SIDECAR_ARGS) as ssc,
        ):
            urls = {"vllm": vsc.ws, "sglang": ssc.ws}
            for flavor, kv, metadata, extra, code in DECODE_REJECTIONS:
                async with open_sidecar(urls[flavor]) as client:
                    async with client.generate(
                        generate_request(**extra), metadata, kv_session_bytes=kv
                    ) as stream:
                        events = [e async for e in stream]
                assert events == [] and stream.end is not None
                assert (stream.end.outcome, stream.end.error.code) == ("rejected", f"ERROR_CODE_{code}"), (
                    flavor,
                    kv,
                    metadata,
                    stream.end,
                )
            for engine in (ve, se):
                counters = await engine_counters(engine.address)
                assert counters["requests_accepted"] == 0 and counters["requests_rejected"] == 0


async def test_sglang_prefill_alone_fails_as_sglang_does(aio_loop: Any, tmp_path: Path) -> None:
    """Without its decode partner a bootstrap prefill waits, then fails (here after 0.3 s)."""
    with trio.fail_after(20):
        async with (
            mock_engine(
                tmp_path, "--flavor", "sglang", "--role", "prefill", "--bootstrap-timeout", "0.3"
            ) as pe,
            sidecar(pe.address, *SIDECAR_ARGS) as psc,
        ):
            card = await _describe(psc.ws)
            ep = card["kvConnector"]["bootstrapEndpoint"]
            session = pb.KvSessionRef(
                handoff_profile="sglang.bootstrap.v1",
                bootstrap=pb.KvBootstrap(
                    endpoint=pb.KvEndpoint(host=ep["host"], port=ep["port"]), room_id=77
                ),
            )
            async with open_sidecar(psc.ws) as client:
                async with client.generate(generate_request(), kv_session_bytes=bytes(session)) as stream:
                    events = [e async for e in stream]
            assert stream.end is not None and stream.end.outcome == "failed"
            assert stream.end.error.code == "ERROR_CODE_KV_TRANSFER_FAILED"
            assert events[-1].response.error is not None
            counters = await idle_and_clean(pe.address)
            assert counters["requests_failed"] == 1


async def test_prefill_and_decode_failover(aio_loop: Any, tmp_path: Path) -> None:
    """Unreachable and refusing (retryable) sidecars are skipped; refusals never reach an engine."""
    with trio.fail_after(30):
        async with (
            pd_stack(tmp_path, "vllm") as pd,
            sidecar(pd.prefill.address, *SIDECAR_ARGS, "--max-streams", "0") as busy_prefill,
            sidecar(pd.decode.address, *SIDECAR_ARGS, "--max-streams", "0") as busy_decode,
        ):
            prefills = [closed_port_url(), busy_prefill.ws, pd.prefill_sc.ws]
            decodes = [busy_decode.ws, pd.decode_sc.ws]
            async with open_disagg(prefills, decodes) as coordinator:
                async with coordinator.generate(generate_request(PROMPT, max_tokens=3)) as flow:
                    events = [e async for e in flow]
            flow.check()
            assert len(token_ids(events)) == 3
            assert [(a.role, a.result, a.code) for a in flow.end.attempts] == [
                ("prefill", "unreachable", "ERROR_CODE_INTERNAL"),
                ("prefill", "rejected", "ERROR_CODE_OVERLOADED"),
                ("prefill", "completed", None),
                ("decode", "rejected", "ERROR_CODE_OVERLOADED"),
                ("decode", "completed", None),
            ]
            for engine in (pd.prefill, pd.decode):
                counters = await idle_and_clean(engine.address)
                assert counters["requests_accepted"] == 1 and counters["requests_rejected"] == 0

            # the command, with repeated --prefill / --decode
            argv = [sys.executable, "-m", "sidecar", "disagg", "--json", "--max-tokens", "2", PROMPT]
            for url in prefills:
                argv += ["--prefill", url]
            for url in decodes:
                argv += ["--decode", url]
            done = await trio.run_process(argv, capture_stdout=True, capture_stderr=True, check=False)
            assert done.returncode == 0, done.stderr.decode()
            lines = [json.loads(line) for line in done.stdout.decode().splitlines()]
            assert lines[0]["phase"] == "prefill" and lines[0]["kvSessionBytes"]
            assert lines[-1]["type"] == "end" and lines[-1]["outcome"] == "completed"
            assert (
                sum(1 for line in lines if line.get("phase") == "decode" and "token" in line["response"]) == 2
            )
            assert b"unreachable" in done.stderr and b"ERROR_CODE_OVERLOADED" in done.stderr


async def test_unpaired_workers_and_pd_media_are_refused_before_any_engine(
    aio_loop: Any, tmp_path: Path
) -> None:
    media = [
        {"modality": "MODALITY_VIDEO", "url": "http://media/v.mp4", "uuid": "vid-1"},
        {"modality": "MODALITY_IMAGE", "dataUri": "data:image/png;base64,AAAA", "uuid": "img-2"},
    ]
    with trio.fail_after(30):
        async with (
            pd_stack(tmp_path, "trtllm") as pd,
            mock_engine(tmp_path, "--flavor", "vllm", "--role", "decode", name="vdecode") as ve,
            sidecar(ve.address, *SIDECAR_ARGS) as vsc,
        ):
            async with open_disagg([pd.prefill_sc.ws], [vsc.ws]) as coordinator:
                async with coordinator.generate(generate_request()) as flow:
                    assert [e async for e in flow] == []
            assert flow.end.outcome == "rejected" and flow.end.error.code == "ERROR_CODE_UNSUPPORTED_FEATURE"
            assert "handoff profiles differ" in flow.end.error.message

            async with open_disagg([pd.prefill_sc.ws], [pd.decode_sc.ws]) as coordinator:
                audio = [{"modality": "MODALITY_AUDIO", "url": "http://media/a.wav"}]
                async with coordinator.generate(generate_request(media=audio)) as flow:
                    assert [e async for e in flow] == []
                assert (
                    flow.end.outcome == "rejected" and flow.end.error.code == "ERROR_CODE_UNSUPPORTED_FEATURE"
                )
                assert "audio" in flow.end.error.message
                for engine in (pd.prefill, pd.decode, ve):
                    counters = await engine_counters(engine.address)
                    assert counters["requests_accepted"] == counters["requests_rejected"] == 0

                # video + image is fine on TensorRT-LLM's P/D path: order and uuids reach both engines
                async with coordinator.generate(generate_request(PROMPT, max_tokens=2, media=media)) as flow:
                    await flow.wait_end()
                flow.check()
            want = [
                {"modality": "MODALITY_VIDEO", "source": "url", "uuid": "vid-1"},
                {"modality": "MODALITY_IMAGE", "source": "data_uri", "uuid": "img-2"},
            ]
            for engine in (pd.prefill, pd.decode):
                [entry] = (await recent(engine.address)).values()
                assert entry["media"] == want
                await idle_and_clean(engine.address)


async def test_cancelling_a_bootstrap_flow_aborts_both_engines(aio_loop: Any, tmp_path: Path) -> None:
    with trio.fail_after(30):
        async with pd_stack(tmp_path, "sglang", prefill_args=("--first-token-delay-ms", "20000")) as pd:
            async with open_disagg([pd.prefill_sc.ws], [pd.decode_sc.ws]) as coordinator:
                with trio.CancelScope() as scope:
                    async with trio.open_nursery() as nursery:

                        async def cancel_when_both_run() -> None:
                            for engine in (pd.prefill, pd.decode):
                                await eventually(
                                    lambda e=engine: _in_flight(e.address, 1),
                                    timeout=10,  # type: ignore[misc]
                                )
                            scope.cancel()

                        nursery.start_soon(cancel_when_both_run)
                        async with coordinator.generate(generate_request(PROMPT, max_tokens=8)) as flow:
                            await flow.wait_end()
            assert flow.end is not None and flow.end.outcome == "cancelled"
            # Both sides are cancelled at once. A side whose stream the cancellation reached gets
            # exactly one Abort. The other may have ended by itself first: when its peer's
            # cancellation lands first, SGLang's bootstrap transfer fails and the request ends
            # failed (then no Abort is due, or one that finds it finished).
            cancelled = 0
            for engine in (pd.prefill, pd.decode):
                counters = await idle_and_clean(engine.address)
                shown = {k: v for k, v in counters.items() if k.startswith(("requests_", "abort"))}
                if _ended_by_cancel(counters):
                    assert _ended_by_cancel(counters) == 1 and counters["aborts_received"] == 1, shown
                else:
                    assert counters["requests_failed"] == 1 and counters["aborts_received"] <= 1, shown
                cancelled += _ended_by_cancel(counters)
            assert cancelled >= 1


async def test_cancelling_a_context_first_flow(aio_loop: Any, tmp_path: Path) -> None:
    """During the prefill: the prefill engine sees the Abort, the decode nothing. During the
    decode: the decode engine sees it, and the prefill holds no KV session (it was pulled)."""
    slow_decode = {"extra": {"mock": {"token_delay_ms": 100}}}
    with trio.fail_after(30):
        async with pd_stack(tmp_path, "vllm", prefill_args=("--first-token-delay-ms", "400")) as pd:
            async with open_disagg([pd.prefill_sc.ws], [pd.decode_sc.ws]) as coordinator:
                with trio.CancelScope() as scope:
                    async with trio.open_nursery() as nursery:

                        async def cancel_during_prefill() -> None:
                            await eventually(lambda: _in_flight(pd.prefill.address, 1), timeout=10)
                            scope.cancel()

                        nursery.start_soon(cancel_during_prefill)
                        async with coordinator.generate(generate_request(PROMPT, max_tokens=50)) as flow:
                            await flow.wait_end()
                assert flow.end is not None and flow.end.outcome == "cancelled"
                counters = await idle_and_clean(pd.prefill.address)
                assert counters["aborts_received"] == 1 and _ended_by_cancel(counters) == 1
                assert (await engine_counters(pd.decode.address))["requests_accepted"] == 0

                async with coordinator.generate(
                    generate_request(PROMPT, max_tokens=50, **slow_decode)
                ) as flow:
                    async for event in flow:
                        if event.response.token is not None:
                            break  # leave mid-decode
                assert flow.end is not None and flow.end.outcome == "cancelled"
            counters = await idle_and_clean(pd.decode.address)
            assert counters["aborts_received"] == 1 and _ended_by_cancel(counters) == 1
            counters = await idle_and_clean(pd.prefill.address)
            assert counters["requests_completed"] == 1 and counters["aborts_received"] == 1


def _ended_by_cancel(counters: dict[str, Any]) -> int:
    """Requests the sidecar ended early: stream closed (then Abort) or aborted while open."""
    return int(counters["requests_cancelled_by_client"] + counters["requests_aborted"])


async def _in_flight(address: str, n: int) -> bool:
    return bool((await engine_counters(address))["requests_in_flight"] == n)


async def test_a_prefill_session_no_decode_pulls_is_released(aio_loop: Any, tmp_path: Path) -> None:
    """Context-first: the prefill completes, then every decode refuses (retryable, skipped):
    the flow ends ``rejected`` and the coordinator releases the prefill's KV session
    (``releaseKvSession`` → the engine's ``Abort{kv_session}`` with the bytes unchanged), so
    the prefill engine holds nothing instead of waiting for its session timeout."""
    with trio.fail_after(30):
        async with (
            pd_stack(tmp_path, "vllm") as pd,
            sidecar(pd.decode.address, *SIDECAR_ARGS, "--max-streams", "0") as busy_decode,
        ):
            async with open_disagg([pd.prefill_sc.ws], [busy_decode.ws]) as coordinator:
                async with coordinator.generate(generate_request(PROMPT, max_tokens=3)) as flow:
                    events = [e async for e in flow]
            assert events == [] and flow.end is not None and flow.end.outcome == "rejected", flow.end
            assert [(a.role, a.result) for a in flow.end.attempts] == [
                ("prefill", "completed"),
                ("decode", "rejected"),
            ]
            counters = await idle_and_clean(pd.prefill.address)  # kv_sessions_open == 0
            assert counters["requests_completed"] == 1 and counters["aborts_received"] == 1
            assert counters["abort_outcomes"].get("ABORTED") == 1, counters["abort_outcomes"]
            assert (await engine_counters(pd.decode.address))["requests_accepted"] == 0

            # the call itself, on the prefill sidecar: again (idempotent), a session the engine
            # never had, then params that are not one KvSessionRef
            assert flow.kv_session_bytes is not None
            async with open_sidecar(pd.prefill_sc.ws) as client:
                b64 = base64.b64encode(flow.kv_session_bytes).decode()
                again = await client.call("releaseKvSession", {"kvSessionBytes": b64})
                assert again["status"] == "ABORT_STATUS_ALREADY_FINISHED", again
                unknown = base64.b64encode(bytes(pb.KvSessionRef(session_id="never-held"))).decode()
                with pytest.raises(SidecarCallError) as info:
                    await client.call("releaseKvSession", {"kvSessionBytes": unknown})
                assert info.value.code == "ERROR_CODE_KV_SESSION_NOT_FOUND"
                for params in ({"kvSessionBytes": "AAAA"}, {"kvSessionBytes": b64, "extra": 1}, {}):
                    with pytest.raises(SidecarCallError) as info:
                        await client.call("releaseKvSession", params)
                    assert info.value.code == "ERROR_CODE_INVALID_ARGUMENT", (params, info.value)
