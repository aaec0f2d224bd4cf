"""What a simulated prefill hands to decode: the session payload, its errors, and the flavours' handoffs.

I/O-free. The transport (server, client, fetch) is ``sidecar.mock.transfer``, which
re-exports everything here; see its docstring for the protocol, the integration
recipe and the attributes of each handoff profile.
"""

from __future__ import annotations

import base64
import hashlib
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from sidecar.mock.kvcache import Allocation
from sidecar.openengine import pb

__all__ = [
    "SGLANG_PROFILE",
    "TRTLLM_PROFILE",
    "VLLM_PROFILE",
    "InvalidKvSession",
    "KvSessionNotFound",
    "KvSessionPayload",
    "KvTransferError",
    "KvTransferFailed",
    "SessionLocator",
    "error_from_code",
    "new_ctx_request_id",
    "prefill_bootstrap_room",
    "resolve_session",
    "sglang_context_session_ref",
    "sglang_session_ref",
    "trtllm_session_ref",
    "verify_payload",
    "vllm_session_ref",
]

VLLM_PROFILE = "vllm.kv_transfer_params.v1"
TRTLLM_PROFILE = "tensorrt_llm.disaggregated_params.v1"
SGLANG_PROFILE = "sglang.bootstrap.v1"
_enc = msgspec.msgpack.Encoder()


# --------------------------------------------------------------------------- errors


class KvTransferError(Exception):
    """An accepted decode (or SGLang prefill) fails: one terminal ``EngineError``."""

    code: pb.ErrorCode = pb.ErrorCode.KV_TRANSFER_FAILED
    retryable = False

    def to_engine_error(self) -> pb.EngineError:
        return pb.EngineError(code=self.code, message=str(self), retryable=self.retryable)


class KvSessionNotFound(KvTransferError):
    code = pb.ErrorCode.KV_SESSION_NOT_FOUND


class KvTransferFailed(KvTransferError):
    code = pb.ErrorCode.KV_TRANSFER_FAILED


class InvalidKvSession(ValueError):
    """A ``KvSessionRef`` that cannot be used (refuse with ``INVALID_ARGUMENT`` before acceptance)."""


def error_from_code(code: str, message: str) -> KvTransferError:
    """The error for a protocol error code name (``KV_SESSION_NOT_FOUND`` or anything else)."""
    return KvSessionNotFound(message) if code == "KV_SESSION_NOT_FOUND" else KvTransferFailed(message)


# --------------------------------------------------------------------------- payload


class KvSessionPayload(msgspec.Struct, kw_only=True):
    """What a prefill hands to decode: block hashes and token count (``extra``: engine's own data)."""

    session_id: str
    dp_rank: int
    block_size: int
    num_tokens: int
    num_blocks: int
    block_hashes: list[int]
    lora_id: int | None = None
    extra: dict[str, Any] = {}

    @classmethod
    def from_allocation(
        cls, session_id: str, alloc: Allocation, extra: dict[str, Any] | None = None
    ) -> KvSessionPayload:
        return cls(
            session_id=session_id,
            dp_rank=alloc.dp_rank,
            block_size=alloc.block_size,
            num_tokens=alloc.num_tokens,
            num_blocks=alloc.num_blocks,
            block_hashes=list(alloc.block_hashes),
            lora_id=alloc.lora_id,
            extra=dict(extra or {}),
        )

    def digest(self) -> str:
        h = hashlib.blake2b(digest_size=16)
        for bh in self.block_hashes:
            h.update(bh.to_bytes(8, "big"))
        return h.hexdigest()


def verify_payload(
    payload: KvSessionPayload,
    expected_hashes: Sequence[int],
    *,
    block_size: int | None = None,
) -> None:
    """Check the pulled blocks against the decode's own hashes of the prompt. Raises :class:`KvTransferFailed`."""
    if block_size is not None and payload.block_size != block_size:
        raise KvTransferFailed(f"KV block size mismatch: prefill {payload.block_size}, decode {block_size}")
    if len(payload.block_hashes) != len(expected_hashes):
        raise KvTransferFailed(
            f"KV block count mismatch: received {len(payload.block_hashes)} full blocks, "
            f"expected {len(expected_hashes)}"
        )
    for i, (got, want) in enumerate(zip(payload.block_hashes, expected_hashes, strict=True)):
        if got != want:
            raise KvTransferFailed(
                f"KV block hash mismatch at block {i}: received {got:#018x}, expected {want:#018x}"
            )


# --------------------------------------------------------------------------- handoffs


def new_ctx_request_id() -> int:
    """A TensorRT-LLM style context request id, always above 2**53 (so it must travel as a string)."""
    return (1 << 60) | secrets.randbits(60)


def _ref(
    profile: str, session_id: str, backend: str, endpoint: pb.KvEndpoint, dp_rank: int, attrs: dict[str, Any]
) -> pb.KvSessionRef:
    return pb.KvSessionRef(
        session_id=session_id,
        transfer_backend=backend,
        endpoints=[endpoint],
        dp_rank=dp_rank,
        attributes_struct=pb.Struct.from_dict(attrs),
        handoff_profile=profile,
    )


def vllm_session_ref(
    *,
    session_id: str,
    engine_id: str,
    endpoint: pb.KvEndpoint,
    num_blocks: int,
    dp_rank: int = 0,
    tp_size: int = 1,
    block_ids: Sequence[int] | None = None,
    transfer_backend: str = "nixl",
) -> pb.KvSessionRef:
    attrs = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": engine_id,
        "remote_request_id": session_id,
        "remote_block_ids": list(block_ids if block_ids is not None else range(num_blocks)),
        "remote_host": endpoint.host,
        "remote_port": endpoint.port,
        "tp_size": tp_size,
    }
    return _ref(VLLM_PROFILE, session_id, transfer_backend, endpoint, dp_rank, attrs)


def trtllm_session_ref(
    *,
    ctx_request_id: int,
    endpoint: pb.KvEndpoint,
    payload: KvSessionPayload,
    first_gen_tokens: Sequence[int] = (),
    draft_tokens: Sequence[int] = (),
    dp_rank: int = 0,
    transfer_backend: str = "ucx",
) -> pb.KvSessionRef:
    """``payload.session_id`` must be ``str(ctx_request_id)`` (the decode pulls by it)."""
    opaque = _enc.encode(
        {"v": 1, "sid": payload.session_id, "n": payload.num_blocks, "digest": payload.digest()}
    )
    attrs = {
        "request_type": "context_only",
        "ctx_request_id": str(ctx_request_id),
        "disagg_request_id": str(ctx_request_id),
        "encoded_opaque_state": base64.b64encode(opaque).decode("ascii"),
        "first_gen_tokens": list(first_gen_tokens),
        "draft_tokens": list(draft_tokens),
        "ctx_dp_rank": dp_rank,
        "ctx_info_endpoint": f"tcp://{endpoint.host}:{endpoint.port}",
    }
    return _ref(TRTLLM_PROFILE, str(ctx_request_id), transfer_backend, endpoint, dp_rank, attrs)


def sglang_context_session_ref(
    *, session_id: str, endpoint: pb.KvEndpoint, dp_rank: int = 0, transfer_backend: str = "mooncake"
) -> pb.KvSessionRef:
    """SGLang on a schema without client bootstrap: the prefill picks the room and hands the
    rendezvous over in ``PrefillReady`` (context-first); the decode pulls by session id."""
    room = secrets.randbits(63) or 1
    attrs = {"bootstrap_host": endpoint.host, "bootstrap_port": endpoint.port, "bootstrap_room": str(room)}
    return _ref(SGLANG_PROFILE, session_id, transfer_backend, endpoint, dp_rank, attrs)


def sglang_session_ref(
    *, bootstrap: pb.KvBootstrap, session_id: str, dp_rank: int = 0, transfer_backend: str = "mooncake"
) -> pb.KvSessionRef:
    ep = bootstrap.endpoint or pb.KvEndpoint()
    attrs = {"bootstrap_host": ep.host, "bootstrap_port": ep.port, "bootstrap_room": str(bootstrap.room_id)}
    ref = _ref(SGLANG_PROFILE, session_id, transfer_backend, ep, dp_rank, attrs)
    ref.bootstrap = pb.KvBootstrap(
        endpoint=pb.KvEndpoint(host=ep.host, port=ep.port, protocol=ep.protocol), room_id=bootstrap.room_id
    )
    return ref


_LOCAL = {"localhost", "127.0.0.1", "::1"}


def prefill_bootstrap_room(ref: pb.KvSessionRef | None, own: pb.KvEndpoint) -> int:
    """The room of an SGLang prefill request; :class:`InvalidKvSession` if missing or not ours."""
    if ref is None or ref.bootstrap is None or ref.bootstrap.endpoint is None:
        raise InvalidKvSession("SGLang prefill needs kv.session.bootstrap with an endpoint and a room")
    ep = ref.bootstrap.endpoint
    same_host = ep.host == own.host or (ep.host in _LOCAL and own.host in _LOCAL)
    if ep.port != own.port or not same_host:
        raise InvalidKvSession(
            f"bootstrap endpoint {ep.host}:{ep.port} is not this prefill engine ({own.host}:{own.port})"
        )
    return ref.bootstrap.room_id


@dataclass(frozen=True)
class SessionLocator:
    """Where and how a decode gets its KV: ``mode`` ``pull`` (by session id) or ``bootstrap`` (by room)."""

    profile: str
    mode: Literal["pull", "bootstrap"]
    host: str
    port: int
    session_id: str
    dp_rank: int
    room: int | None = None
    expected_num_blocks: int | None = None
    opaque_digest: str | None = None


def _attr(attrs: dict[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    value = attrs.get(key)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise InvalidKvSession(f"handoff attribute {key!r} missing or malformed")
    return value


def _hostport(url: str) -> tuple[str, int]:
    rest = url.split("://", 1)[-1]
    host, _, port = rest.rpartition(":")
    if not host or not port.isdigit():
        raise InvalidKvSession(f"bad endpoint {url!r}")
    return host.strip("[]"), int(port)


def resolve_session(ref: pb.KvSessionRef, *, default_profile: str = "") -> SessionLocator:
    """Read a decode request's ``KvSessionRef`` per its handoff profile (``default_profile``, the
    engine's own, when the session names none: a schema without the field). Raises
    :class:`InvalidKvSession`."""
    attrs = ref.attributes_struct.to_dict() if ref.attributes_struct is not None else {}
    profile = ref.handoff_profile or default_profile
    if profile == VLLM_PROFILE:
        if attrs.get("do_remote_prefill") is not True:
            raise InvalidKvSession("vLLM handoff without do_remote_prefill=true")
        return SessionLocator(
            profile=profile,
            mode="pull",
            host=_attr(attrs, "remote_host", str),
            port=int(_attr(attrs, "remote_port", (int, float))),
            session_id=_attr(attrs, "remote_request_id", str),
            dp_rank=ref.dp_rank,
            expected_num_blocks=len(_attr(attrs, "remote_block_ids", list)),
        )
    if profile == TRTLLM_PROFILE:
        if attrs.get("request_type") not in ("context_only", "generation_only"):
            raise InvalidKvSession("TensorRT-LLM handoff with a bad request_type")
        ctx_id = _attr(attrs, "ctx_request_id", str)
        if not ctx_id.isdigit():
            raise InvalidKvSession("ctx_request_id must be a decimal string")
        host, port = _hostport(_attr(attrs, "ctx_info_endpoint", str))
        try:
            opaque = msgspec.msgpack.decode(
                base64.b64decode(_attr(attrs, "encoded_opaque_state", str), validate=True)
            )
            n, digest, sid = int(opaque["n"]), str(opaque["digest"]), str(opaque["sid"])
        except (ValueError, KeyError, TypeError, msgspec.DecodeError) as err:
            raise InvalidKvSession(f"encoded_opaque_state unreadable: {err}") from None
        if sid != ctx_id:
            raise InvalidKvSession("encoded_opaque_state belongs to another context request")
        return SessionLocator(
            profile=profile,
            mode="pull",
            host=host,
            port=port,
            session_id=ctx_id,
            dp_rank=ref.dp_rank,
            expected_num_blocks=n,
            opaque_digest=digest,
        )
    if (profile == SGLANG_PROFILE and ref.bootstrap is None) and ref.endpoints and ref.session_id:
        ep = ref.endpoints[0]  # context-first SGLang (no client bootstrap): pull what the prefill holds
        _attr(attrs, "bootstrap_room", str)
        return SessionLocator(profile, "pull", ep.host, ep.port, ref.session_id, ref.dp_rank)
    if profile == SGLANG_PROFILE or ref.bootstrap is not None:
        bs = ref.bootstrap
        if bs is None or bs.endpoint is None or not bs.endpoint.host or not bs.endpoint.port:
            raise InvalidKvSession("SGLang handoff needs kv.session.bootstrap with an endpoint and a room")
        return SessionLocator(
            profile=profile,
            mode="bootstrap",
            host=bs.endpoint.host,
            port=bs.endpoint.port,
            session_id=ref.session_id,
            dp_rank=ref.dp_rank,
            room=bs.room_id,
        )
    if ref.endpoints and ref.session_id:
        ep = ref.endpoints[0]
        return SessionLocator(profile, "pull", ep.host, ep.port, ref.session_id, ref.dp_rank)
    raise InvalidKvSession(f"unusable KV session (profile {profile!r}, no endpoint or session id)")
