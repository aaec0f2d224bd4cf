"""Prefill/decode pairs of every flavour, end to end (in-process engines, real sockets)."""

from __future__ import annotations

import base64
import random
from typing import Any

import pytest
import trio

from sidecar.openengine import pb
from sidecar.openengine.engine_errors import EngineTerminalError

from .helpers import (
    collect,
    counters,
    engine,
    final_usage,
    finishes,
    kind,
    request,
    text,
    token_ids,
    wait_for,
)

REQ = {"prompt": " ba be bi" * 12, "stopping": pb.StoppingOptions(max_tokens=12, ignore_eos=True)}


def with_session(req: pb.GenerateRequest, session: pb.KvSessionRef) -> pb.GenerateRequest:
    out = pb.GenerateRequest.parse(bytes(req))
    out.kv = pb.KvOptions(session=session)
    return out


async def prefill_ready(
    client: Any, req: pb.GenerateRequest
) -> tuple[pb.KvSessionRef, list[pb.GenerateResponse]]:
    events = await collect(client, req)
    assert kind(events[-1]) == "prefill_ready" and events[-1].usage is not None
    assert [kind(e) for e in events].count("token") == 0
    session = events[-1].prefill_ready.kv_session  # type: ignore[union-attr]
    assert session is not None
    return session, events


@pytest.mark.parametrize("flavor", ["vllm", "trtllm"])
async def test_context_first_pair_matches_aggregated(aio_loop: Any, flavor: str) -> None:
    async with (
        engine(flavor=flavor, role="aggregated") as (_, agg),
        engine(flavor=flavor, role="prefill") as (_, pre),
        engine(flavor=flavor, role="decode") as (_, dec),
    ):
        reference = await collect(agg, request("agg", **REQ))
        session, pevents = await prefill_ready(pre, request("p", **REQ))
        assert final_usage(pevents).completion_tokens == 0
        attrs = session.attributes_struct.to_dict() if session.attributes_struct else {}
        if flavor == "vllm":
            assert (
                session.handoff_profile == "vllm.kv_transfer_params.v1" and session.transfer_backend == "nixl"
            )
            assert attrs["do_remote_prefill"] is True and len(attrs["remote_block_ids"]) == 3
        else:
            assert session.handoff_profile == "tensorrt_llm.disaggregated_params.v1"
            assert int(attrs["ctx_request_id"]) > 2**53 and attrs["request_type"] == "context_only"
            base64.b64decode(attrs["encoded_opaque_state"], validate=True)
            assert attrs["first_gen_tokens"] == [token_ids(reference)[0]]
        assert (await counters(pre))["kv_sessions_open"] == 1
        assert ((await pre.get_load()).used_kv_blocks or 0) > 0
        decoded = await collect(dec, with_session(request("d", **REQ), session))
        assert token_ids(decoded) == token_ids(reference) and text(decoded) == text(reference)
        assert finishes(decoded)[0].reason == pb.FinishReason.LENGTH
        assert final_usage(decoded).prompt_tokens == final_usage(reference).prompt_tokens
        await wait_for(pre, lambda a: a["kv_sessions_open"] == 0)
        assert (await pre.get_load()).used_kv_blocks == 0
        with pytest.raises(EngineTerminalError) as info:
            await collect(dec, with_session(request("again", **REQ), session))
        assert info.value.code == pb.ErrorCode.KV_SESSION_NOT_FOUND
        assert final_usage([info.value.event]).completion_tokens == 0  # type: ignore[list-item]


async def test_decode_checks_what_it_pulls(aio_loop: Any) -> None:
    async with engine(role="prefill") as (_, pre), engine(role="decode") as (_, dec):
        session, _ = await prefill_ready(pre, request("p", **REQ))
        other = request("d", prompt=" vu" * 40, stopping=REQ["stopping"])
        with pytest.raises(EngineTerminalError) as info:
            await collect(dec, with_session(other, session))
        assert info.value.code == pb.ErrorCode.KV_TRANSFER_FAILED
        attrs = await counters(dec)
        assert attrs["requests_failed"] == 1 and attrs["requests_accepted"] == 1


async def test_unreachable_prefill_fails_transfer(aio_loop: Any) -> None:
    async with engine(role="prefill") as (_, pre), engine(role="decode") as (_, dec):
        session, _ = await prefill_ready(pre, request("p", **REQ))
    assert session.attributes_struct is not None
    async with engine(role="decode") as (_, dec):
        with pytest.raises(EngineTerminalError) as info:
            await collect(dec, with_session(request("d", **REQ), session))
        assert info.value.code == pb.ErrorCode.KV_TRANSFER_FAILED


async def test_session_expires(aio_loop: Any) -> None:
    async with (
        engine(role="prefill", kv_session_timeout_s=0.05) as (_, pre),
        engine(role="decode") as (_, dec),
    ):
        session, _ = await prefill_ready(pre, request("p", **REQ))
        await wait_for(pre, lambda a: a["kv_sessions_open"] == 0)
        with pytest.raises(EngineTerminalError) as info:
            await collect(dec, with_session(request("d", **REQ), session))
        assert info.value.code == pb.ErrorCode.KV_SESSION_NOT_FOUND


async def test_abort_releases_held_sessions(aio_loop: Any) -> None:
    async with engine(role="prefill") as (_, pre), engine(role="decode") as (_, dec):
        session, _ = await prefill_ready(pre, request("p1", **REQ))
        reply = await pre.abort(pb.AbortRequest(kv_session=session))
        assert reply.status == pb.AbortStatus.ABORTED
        with pytest.raises(EngineTerminalError) as info:
            await collect(dec, with_session(request("d", **REQ), session))
        assert info.value.code == pb.ErrorCode.KV_SESSION_NOT_FOUND
        assert (
            await pre.abort(pb.AbortRequest(kv_session=session))
        ).status == pb.AbortStatus.ALREADY_FINISHED
        await prefill_ready(pre, request("p2", **REQ))
        assert (await counters(pre))["kv_sessions_open"] == 1
        assert (await pre.abort(pb.AbortRequest(request_id="p2"))).status == pb.AbortStatus.ABORTED
        assert (await counters(pre))["kv_sessions_open"] == 0
        assert (await pre.abort(pb.AbortRequest(request_id="p2"))).status == pb.AbortStatus.ALREADY_FINISHED
        assert (await pre.get_load()).used_kv_blocks == 0


async def test_prefill_drain_waits_for_sessions(aio_loop: Any) -> None:
    async with engine(role="prefill") as (_, pre):
        await prefill_ready(pre, request("p", **REQ))
        with trio.fail_after(10):
            async with pre.drain(
                pb.DrainRequest(stop_accepting_new_requests=True, deadline_ms=50, abort_after_deadline=True)
            ) as d:
                events = [e async for e in d]
        assert events[0].open_kv_sessions == 1
        assert events[-1].state == pb.DrainState.COMPLETE and events[-1].open_kv_sessions == 0


def bootstrap_for(info: pb.ServerInfo, room: int) -> pb.KvSessionRef:
    assert info.kv_connector is not None and info.kv_connector.supports_client_bootstrap is True
    [ep] = info.kv_connector.local_endpoints
    return pb.KvSessionRef(
        handoff_profile="sglang.bootstrap.v1", bootstrap=pb.KvBootstrap(endpoint=ep, room_id=room)
    )


async def test_sglang_bootstrap_pair(aio_loop: Any) -> None:
    async with (
        engine(flavor="sglang") as (_, agg),
        engine(flavor="sglang", role="prefill") as (_, pre),
        engine(flavor="sglang", role="decode") as (_, dec),
    ):
        reference = await collect(agg, request("agg", **REQ))
        room = random.getrandbits(63) | 1 << 62
        ref = bootstrap_for(await pre.get_server_info(), room)
        results: dict[str, list[pb.GenerateResponse]] = {}

        async def run(name: str, client: Any) -> None:
            results[name] = await collect(client, with_session(request(name, **REQ), ref))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, "p", pre)
            nursery.start_soon(run, "d", dec)
        assert kind(results["p"][-1]) == "prefill_ready"
        ready = results["p"][-1].prefill_ready
        assert ready is not None and ready.kv_session is not None
        assert ready.kv_session.bootstrap == ref.bootstrap
        assert ready.kv_session.attributes_struct.to_dict()["bootstrap_room"] == str(room)  # type: ignore[union-attr]
        assert token_ids(results["d"]) == token_ids(reference)


async def test_sglang_prefill_alone_fails(aio_loop: Any) -> None:
    async with engine(flavor="sglang", role="prefill", bootstrap_timeout_s=0.1) as (_, pre):
        ref = bootstrap_for(await pre.get_server_info(), 12345)
        with pytest.raises(EngineTerminalError) as info:
            await collect(pre, with_session(request("p", **REQ), ref))
        assert info.value.code == pb.ErrorCode.KV_TRANSFER_FAILED
        assert (await pre.get_load()).used_kv_blocks == 0
        wrong = pb.KvSessionRef(
            bootstrap=pb.KvBootstrap(
                endpoint=pb.KvEndpoint(host="10.9.9.9", port=1, protocol="tcp"), room_id=1
            )
        )
        from sidecar.openengine.engine_errors import EngineStatusError

        with pytest.raises(EngineStatusError) as status:
            await collect(pre, with_session(request("q", **REQ), wrong))
        assert status.value.status == "INVALID_ARGUMENT"


async def test_sglang_abort_waiting_prefill_by_room(aio_loop: Any) -> None:
    async with engine(flavor="sglang", role="prefill", bootstrap_timeout_s=30) as (_, pre):
        ref = bootstrap_for(await pre.get_server_info(), 77)
        async with pre.generate(with_session(request("p", **REQ), ref)) as stream:
            await wait_for(pre, lambda a: a["requests_in_flight"] == 1)
            assert (await pre.abort(pb.AbortRequest(kv_session=ref))).status == pb.AbortStatus.ABORTED
            with pytest.raises(EngineTerminalError) as info:
                [e async for e in stream]
            assert info.value.code == pb.ErrorCode.CANCELLED
        attrs = await counters(pre)
        assert attrs["requests_aborted"] == 1 and attrs["kv_sessions_open"] == 0
