"""Prefill → decode KV transfer over real TCP sockets, and the flavours' handoffs."""

from __future__ import annotations

import asyncio
import base64
import socket
from typing import Any

import msgspec
import pytest
import trio
import trio.testing
from trio_asyncio import aio_as_trio

from sidecar.mock.kvcache import KvCache, compute_block_hashes
from sidecar.mock.transfer import (
    SGLANG_PROFILE,
    TRTLLM_PROFILE,
    VLLM_PROFILE,
    InvalidKvSession,
    KvSessionNotFound,
    KvSessionPayload,
    KvTransferFailed,
    KvTransferServer,
    fetch_session,
    new_ctx_request_id,
    prefill_bootstrap_room,
    pull_session,
    resolve_session,
    sglang_session_ref,
    trtllm_session_ref,
    verify_payload,
    vllm_session_ref,
)
from sidecar.openengine import pb

BS = 4
PROMPT = list(range(1, 15))  # 3 full blocks + a tail of 2


def over_the_wire(ref: pb.KvSessionRef) -> pb.KvSessionRef:
    """What the decode engine receives: the bytes of the handoff, parsed (Struct numbers become doubles)."""
    return pb.KvSessionRef.parse(bytes(ref))


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prefill:
    """A prefill side: cache + transfer server; tracks releases."""

    def __init__(self, server: KvTransferServer) -> None:
        self.server = server
        self.cache = KvCache(0, BS, 32)
        self.released = asyncio.Event()

    def hold(self, session_id: str, *, ttl: float | None = None) -> KvSessionPayload:
        alloc = self.cache.allocate(PROMPT)
        payload = KvSessionPayload.from_allocation(session_id, alloc, extra={"first_token": 7})

        def release() -> None:
            self.cache.release(alloc)
            self.released.set()

        self.server.hold(payload, release=release, ttl=ttl)
        return payload


async def open_server(**kw: Any) -> Any:
    return aio_as_trio(KvTransferServer(**kw))


async def test_vllm_pull_verify_and_consume(aio_loop: Any) -> None:
    with trio.fail_after(10):
        async with await open_server() as server:
            prefill = Prefill(server)
            payload = prefill.hold("sess-1")
            assert prefill.cache.used_blocks == 4 and server.open_sessions == 1
            ref = vllm_session_ref(
                session_id="sess-1",
                engine_id="eng-A",
                endpoint=server.endpoint,
                num_blocks=payload.num_blocks,
            )
            ref = over_the_wire(ref)
            assert ref.handoff_profile == VLLM_PROFILE and ref.transfer_backend == "nixl"
            attrs = ref.attributes_struct.to_dict()  # type: ignore[union-attr]
            assert attrs["do_remote_prefill"] is True and attrs["do_remote_decode"] is False
            assert attrs["remote_block_ids"] == [0.0, 1.0, 2.0, 3.0] and attrs["remote_port"] == server.port
            assert {"remote_engine_id", "remote_request_id", "remote_host", "tp_size"} <= attrs.keys()

            locator = resolve_session(ref)
            got = await aio_as_trio(fetch_session)(locator)
            verify_payload(got, compute_block_hashes(PROMPT, BS), block_size=BS)
            assert got == payload and got.extra == {"first_token": 7} and got.num_tokens == len(PROMPT)
            assert prefill.released.is_set() and prefill.cache.used_blocks == 0  # pulled → released
            with pytest.raises(KvSessionNotFound):  # consumed
                await aio_as_trio(fetch_session)(locator)


async def test_hash_and_block_count_mismatch_are_transfer_failures(aio_loop: Any) -> None:
    with trio.fail_after(10):
        async with await open_server() as server:
            prefill = Prefill(server)
            payload = prefill.hold("s")
            got = await aio_as_trio(pull_session)(server.host, server.port, "s")
            other_prompt = [*PROMPT[:5], 99, *PROMPT[6:]]
            with pytest.raises(KvTransferFailed, match="hash mismatch at block 1"):
                verify_payload(got, compute_block_hashes(other_prompt, BS))
            with pytest.raises(KvTransferFailed, match="count"):
                verify_payload(got, compute_block_hashes(PROMPT[:8], BS))
            with pytest.raises(KvTransferFailed, match="block size"):
                verify_payload(got, compute_block_hashes(PROMPT, BS), block_size=8)
            # a handoff naming another number of blocks than the prefill sends
            prefill.hold("s2")
            ref = vllm_session_ref(session_id="s2", engine_id="e", endpoint=server.endpoint, num_blocks=2)
            with pytest.raises(KvTransferFailed, match="count"):
                await aio_as_trio(fetch_session)(resolve_session(over_the_wire(ref)))
            assert payload.num_blocks == 4


async def test_missing_expired_and_unreachable(aio_loop: Any) -> None:
    with trio.fail_after(10):
        async with await open_server(session_ttl=30) as server:
            with pytest.raises(KvSessionNotFound) as missing:
                await aio_as_trio(pull_session)(server.host, server.port, "nope")
            err = missing.value.to_engine_error()
            assert err.code == pb.ErrorCode.KV_SESSION_NOT_FOUND and not err.retryable
            prefill = Prefill(server)
            prefill.hold("short", ttl=0.05)
            await aio_as_trio(prefill.released.wait)()  # the TTL fired and released the blocks
            assert not server.has_session("short") and prefill.cache.used_blocks == 0
            with pytest.raises(KvSessionNotFound):
                await aio_as_trio(pull_session)(server.host, server.port, "short")
            # Abort{kv_session}
            prefill.hold("dropped")
            assert server.drop("dropped") and not server.drop("dropped")
            assert server.drop_all() == 0
        with pytest.raises(KvTransferFailed) as failed:
            await aio_as_trio(pull_session)("127.0.0.1", closed_port(), "x", timeout=5)
        assert failed.value.to_engine_error().code == pb.ErrorCode.KV_TRANSFER_FAILED


async def test_server_close_releases_held_sessions(aio_loop: Any) -> None:
    with trio.fail_after(10):
        async with await open_server() as server:
            prefill = Prefill(server)
            prefill.hold("a")
        assert prefill.released.is_set() and prefill.cache.used_blocks == 0


async def test_trtllm_handoff_large_id_and_opaque_state(aio_loop: Any) -> None:
    with trio.fail_after(10):
        async with await open_server() as server:
            prefill = Prefill(server)
            ctx_id = new_ctx_request_id()
            assert ctx_id > 2**53
            payload = prefill.hold(str(ctx_id))
            ref = trtllm_session_ref(
                ctx_request_id=ctx_id,
                endpoint=server.endpoint,
                payload=payload,
                first_gen_tokens=[7],
                dp_rank=0,
            )
            wire = over_the_wire(ref)
            attrs = wire.attributes_struct.to_dict()  # type: ignore[union-attr]
            assert wire.handoff_profile == TRTLLM_PROFILE and wire.session_id == str(ctx_id)
            assert attrs["ctx_request_id"] == str(ctx_id) and attrs["disagg_request_id"] == str(ctx_id)
            assert attrs["request_type"] == "context_only" and attrs["first_gen_tokens"] == [7.0]
            assert attrs["ctx_info_endpoint"] == f"tcp://{server.host}:{server.port}"
            base64.b64decode(attrs["encoded_opaque_state"], validate=True)

            # a mangled opaque state is refused before anything is pulled
            bad = over_the_wire(ref)
            bad.attributes_struct.fields["encoded_opaque_state"] = pb.Value(string_value="!!")  # type: ignore[union-attr]
            with pytest.raises(InvalidKvSession):
                resolve_session(bad)
            # the generation leg may carry request_type generation_only
            wire.attributes_struct.fields["request_type"] = pb.Value(string_value="generation_only")  # type: ignore[union-attr]
            got = await aio_as_trio(fetch_session)(resolve_session(wire))
            verify_payload(got, compute_block_hashes(PROMPT, BS))

            # opaque state of another session's blocks → transfer failure
            p2 = prefill.hold(str(ctx_id + 1))
            forged = msgspec.structs.replace(p2, block_hashes=[h ^ 1 for h in p2.block_hashes])
            ref2 = trtllm_session_ref(ctx_request_id=ctx_id + 1, endpoint=server.endpoint, payload=forged)
            with pytest.raises(KvTransferFailed, match="opaque"):
                await aio_as_trio(fetch_session)(resolve_session(over_the_wire(ref2)))


def _bootstrap(server: KvTransferServer, room: int) -> pb.KvBootstrap:
    return pb.KvBootstrap(
        endpoint=pb.KvEndpoint(host=server.host, port=server.port, protocol="tcp"), room_id=room
    )


@pytest.mark.parametrize("first", ["prefill", "decode"])
async def test_sglang_rendezvous(aio_loop: Any, first: str) -> None:
    room = 2**63 + 5  # a real uint64 room id beyond a double's exact range
    with trio.fail_after(10):
        async with await open_server(bootstrap_timeout=5) as server:
            prefill = Prefill(server)
            bootstrap = _bootstrap(server, room)
            request_ref = pb.KvSessionRef(bootstrap=bootstrap, handoff_profile=SGLANG_PROFILE)
            assert prefill_bootstrap_room(over_the_wire(request_ref), server.endpoint) == room
            locator = resolve_session(over_the_wire(request_ref))
            assert locator.mode == "bootstrap" and locator.room == room
            alloc = prefill.cache.allocate(PROMPT)
            payload = KvSessionPayload.from_allocation("sg-1", alloc)
            got: list[KvSessionPayload] = []

            async def run_prefill() -> None:
                await aio_as_trio(server.send_bootstrap)(room, payload, lambda: prefill.cache.release(alloc))

            async def run_decode() -> None:
                got.append(await aio_as_trio(fetch_session)(locator))

            async with trio.open_nursery() as nursery:
                if first == "prefill":
                    nursery.start_soon(run_prefill)
                    await trio.testing.wait_all_tasks_blocked()
                    assert server.open_sessions == 1  # the room waits for its decode
                    nursery.start_soon(run_decode)
                else:
                    nursery.start_soon(run_decode)
                    while server.open_sessions == 0:  # the decode's registration has arrived
                        await trio.testing.wait_all_tasks_blocked(0.001)
                    nursery.start_soon(run_prefill)
            [received] = got
            verify_payload(received, compute_block_hashes(PROMPT, BS))
            assert prefill.cache.used_blocks == 0 and server.open_sessions == 0
            ref = over_the_wire(sglang_session_ref(bootstrap=bootstrap, session_id="sg-1"))
            assert ref.bootstrap is not None and ref.bootstrap.room_id == room  # echoed exactly
            assert ref.attributes_struct.to_dict()["bootstrap_room"] == str(room)  # type: ignore[union-attr]


async def test_sglang_prefill_alone_times_out_and_decode_alone_too(aio_loop: Any) -> None:
    with trio.fail_after(10):
        async with await open_server(bootstrap_timeout=0.2) as server:
            prefill = Prefill(server)
            alloc = prefill.cache.allocate(PROMPT)
            payload = KvSessionPayload.from_allocation("alone", alloc)
            with pytest.raises(KvTransferFailed, match="no decode registered") as err:
                await aio_as_trio(server.send_bootstrap)(7, payload, lambda: prefill.cache.release(alloc))
            assert err.value.to_engine_error().code == pb.ErrorCode.KV_TRANSFER_FAILED
            assert prefill.cache.used_blocks == 0 and server.open_sessions == 0
            with pytest.raises(KvTransferFailed, match="no prefill"):
                await aio_as_trio(fetch_session)(
                    resolve_session(pb.KvSessionRef(bootstrap=_bootstrap(server, 8)))
                )
            assert server.open_sessions == 0


async def test_sglang_abort_room_fails_waiting_decode(aio_loop: Any) -> None:
    with trio.fail_after(10):
        async with await open_server(bootstrap_timeout=30) as server:
            locator = resolve_session(pb.KvSessionRef(bootstrap=_bootstrap(server, 9)))
            async with trio.open_nursery() as nursery:

                async def decode() -> None:
                    with pytest.raises(KvTransferFailed, match="aborted"):
                        await aio_as_trio(fetch_session)(locator)

                nursery.start_soon(decode)
                while not server.abort_room(9):  # until the decode's registration has arrived
                    await trio.testing.wait_all_tasks_blocked(0.001)
            assert server.open_sessions == 0


def test_invalid_handoffs_are_refused() -> None:
    own = pb.KvEndpoint(host="127.0.0.1", port=4000, protocol="tcp")
    with pytest.raises(InvalidKvSession):
        prefill_bootstrap_room(pb.KvSessionRef(), own)
    elsewhere = pb.KvBootstrap(endpoint=pb.KvEndpoint(host="127.0.0.1", port=4001), room_id=1)
    with pytest.raises(InvalidKvSession):
        prefill_bootstrap_room(pb.KvSessionRef(bootstrap=elsewhere), own)
    with pytest.raises(InvalidKvSession):
        resolve_session(pb.KvSessionRef(handoff_profile=VLLM_PROFILE))
    no_remote = vllm_session_ref(session_id="s", engine_id="e", endpoint=own, num_blocks=1)
    no_remote.attributes_struct.fields["do_remote_prefill"] = pb.Value(bool_value=False)  # type: ignore[union-attr]
    with pytest.raises(InvalidKvSession):
        resolve_session(no_remote)
    with pytest.raises(InvalidKvSession):
        resolve_session(pb.KvSessionRef(handoff_profile=SGLANG_PROFILE))
    with pytest.raises(InvalidKvSession):
        resolve_session(pb.KvSessionRef(session_id="x"))
    generic = resolve_session(pb.KvSessionRef(session_id="x", endpoints=[own]))
    assert (generic.mode, generic.host, generic.port, generic.session_id) == ("pull", "127.0.0.1", 4000, "x")
