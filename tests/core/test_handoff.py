from __future__ import annotations

import re

import pytest

from sidecar.core.errors import Rejection
from sidecar.core.handoff import (
    check_bootstrap,
    check_decode_session,
    check_prefill_session,
    parse_kv_session,
)
from sidecar.openengine import pb
from sidecar.openengine.schema.protobuf_wire import WireError

from .shapes import SGLANG_BOOTSTRAP, R, card_of, sglang_card, sglang_info, trtllm_card, vllm_card

E = pb.ErrorCode
VLLM_PROFILE = "vllm.kv_transfer_params.v1"


def vllm_session(**kw: object) -> pb.KvSessionRef:
    base: dict[str, object] = {
        "session_id": "s1",
        "transfer_backend": "nixl",
        "handoff_profile": VLLM_PROFILE,
        "dp_rank": 0,
        "attributes_struct": pb.Struct.from_dict({"do_remote_prefill": True, "remote_block_ids": [1, 2]}),
    }
    base.update(kw)
    return pb.KvSessionRef(**base)  # type: ignore[arg-type]


def boot(room: int = 12345, endpoint: pb.KvEndpoint | None = SGLANG_BOOTSTRAP) -> pb.KvBootstrap:
    return pb.KvBootstrap(endpoint=endpoint, room_id=room)


def sgl_session(**kw: object) -> pb.KvSessionRef:
    base: dict[str, object] = {"handoff_profile": "sglang.bootstrap.v1", "bootstrap": boot()}
    base.update(kw)
    return pb.KvSessionRef(**base)  # type: ignore[arg-type]


def test_parse_kv_session_keeps_unknown_fields() -> None:
    s = vllm_session()
    data = bytes(s) + bytes([0xA0, 0x06, 0x01])  # field 100, varint 1: a newer revision's field
    parsed = parse_kv_session(data)
    assert parsed.handoff_profile == VLLM_PROFILE
    assert bytes(parsed) == data


@pytest.mark.parametrize(
    "data",
    [
        b"\xff\xff\xff",
        b"\x0a\x10abc",  # truncated length-delimited field
        b"\x0b",  # group wire type
        b"\x00\x00",  # field number 0
        b"\x3a\x02\x0a\x05",  # bootstrap with a truncated endpoint
        b"\x3a\x02\xff\xff",  # bootstrap with a truncated varint
        b"\x0a\x02\xff\xfe",  # session_id not UTF-8
        b"\x21\x00",  # truncated fixed64
    ],
)
def test_parse_kv_session_rejects(data: bytes) -> None:
    with pytest.raises(WireError):
        parse_kv_session(data)


# (case id, card, session, target rank, expected code or None, message fragment)
DECODE_CASES = [
    ("vllm ok", vllm_card(R.DECODE), vllm_session(), None, None, ""),
    ("vllm ok target", vllm_card(R.DECODE, dp=2), vllm_session(dp_rank=1), 1, None, ""),
    ("vllm empty backend ok", vllm_card(R.DECODE), vllm_session(transfer_backend=""), None, None, ""),
    ("vllm backend case", vllm_card(R.DECODE), vllm_session(transfer_backend="NIXL"), None, None, ""),
    (
        "trt ok",
        trtllm_card(R.DECODE),
        vllm_session(handoff_profile="tensorrt_llm.disaggregated_params.v1", transfer_backend="ucx"),
        None,
        None,
        "",
    ),
    ("sgl ok", sglang_card(R.DECODE), sgl_session(), None, None, ""),
    ("sgl ok no profile", sglang_card(R.DECODE), sgl_session(handoff_profile=""), None, None, ""),
    (
        "sgl ok other endpoint",
        sglang_card(R.DECODE),
        sgl_session(bootstrap=boot(endpoint=pb.KvEndpoint(host="10.9.9.9", port=1))),
        None,
        None,
        "",
    ),
    (
        "profile mismatch",
        vllm_card(R.DECODE),
        vllm_session(handoff_profile="sglang.bootstrap.v1"),
        None,
        E.UNSUPPORTED_FEATURE,
        "handoff_profile 'sglang.bootstrap.v1' does not match",
    ),
    (
        "unknown profile",
        vllm_card(R.DECODE),
        vllm_session(handoff_profile="x.y.v9"),
        None,
        E.UNSUPPORTED_FEATURE,
        "does not match",
    ),
    (
        "no profile context-first",
        vllm_card(R.DECODE),
        vllm_session(handoff_profile=""),
        None,
        E.INVALID_ARGUMENT,
        "has no handoff_profile",
    ),
    (
        "backend mismatch",
        vllm_card(R.DECODE),
        vllm_session(transfer_backend="mooncake"),
        None,
        E.UNSUPPORTED_FEATURE,
        "transfer_backend 'mooncake' does not match",
    ),
    (
        "rank outside",
        vllm_card(R.DECODE),
        vllm_session(dp_rank=1),
        None,
        E.INVALID_ARGUMENT,
        "dp_rank 1 is not a DP rank of this worker (0)",
    ),
    (
        "rank conflict",
        vllm_card(R.DECODE, dp=2),
        vllm_session(dp_rank=0),
        1,
        E.INVALID_ARGUMENT,
        "openengine-target-dp-rank 1 conflicts with kv.session dp_rank 0",
    ),
    (
        "bootstrap on context-first",
        vllm_card(R.DECODE),
        vllm_session(bootstrap=boot()),
        None,
        E.INVALID_ARGUMENT,
        "does not use client bootstrap",
    ),
    (
        "sgl missing bootstrap",
        sglang_card(R.DECODE),
        sgl_session(bootstrap=None),
        None,
        E.INVALID_ARGUMENT,
        "kv.session.bootstrap is required",
    ),
    (
        "sgl room zero",
        sglang_card(R.DECODE),
        sgl_session(bootstrap=boot(room=0)),
        None,
        E.INVALID_ARGUMENT,
        "room_id must be non-zero",
    ),
    (
        "sgl no endpoint",
        sglang_card(R.DECODE),
        sgl_session(bootstrap=boot(endpoint=None)),
        None,
        E.INVALID_ARGUMENT,
        "has no endpoint host",
    ),
    (
        "sgl empty host",
        sglang_card(R.DECODE),
        sgl_session(bootstrap=boot(endpoint=pb.KvEndpoint(port=1))),
        None,
        E.INVALID_ARGUMENT,
        "has no endpoint host",
    ),
    (
        "sgl port zero",
        sglang_card(R.DECODE),
        sgl_session(bootstrap=boot(endpoint=pb.KvEndpoint(host="h"))),
        None,
        E.INVALID_ARGUMENT,
        "port 0 is out of range",
    ),
    (
        "sgl port big",
        sglang_card(R.DECODE),
        sgl_session(bootstrap=boot(endpoint=pb.KvEndpoint(host="h", port=70000))),
        None,
        E.INVALID_ARGUMENT,
        "port 70000 is out of range",
    ),
    (
        "sgl profile mismatch",
        sglang_card(R.DECODE),
        sgl_session(handoff_profile=VLLM_PROFILE),
        None,
        E.UNSUPPORTED_FEATURE,
        "does not match",
    ),
    ("sgl rank conflict", sglang_card(R.DECODE), sgl_session(dp_rank=1), 0, E.INVALID_ARGUMENT, "conflicts"),
]


@pytest.mark.parametrize(
    ("card", "session", "target", "code", "fragment"),
    [c[1:] for c in DECODE_CASES],
    ids=[c[0] for c in DECODE_CASES],
)
def test_decode_envelope(card, session, target, code, fragment) -> None:  # type: ignore[no-untyped-def]
    if code is None:
        check_decode_session(session, card, target_dp_rank=target)
        return
    with pytest.raises(Rejection, match=re.escape(fragment)) as exc:
        check_decode_session(session, card, target_dp_rank=target)
    assert exc.value.code == code
    assert not exc.value.retryable


def test_decode_without_connector() -> None:
    info, models = sglang_info(R.DECODE)
    info.kv_connector = None
    with pytest.raises(Rejection, match="no enabled KV connector") as exc:
        check_decode_session(sgl_session(), card_of((info, models)))
    assert exc.value.code == E.UNSUPPORTED_FEATURE


PREFILL_CASES = [
    ("ok", sgl_session(), None, None, ""),
    ("ok rank", sgl_session(dp_rank=1), 1, None, ""),
    ("ok no profile", sgl_session(handoff_profile="", transfer_backend="mooncake"), None, None, ""),
    (
        "ok host case",
        sgl_session(bootstrap=boot(endpoint=pb.KvEndpoint(host="10.0.0.5", port=8998))),
        None,
        None,
        "",
    ),
    (
        "other endpoint",
        sgl_session(bootstrap=boot(endpoint=pb.KvEndpoint(host="10.0.0.6", port=8998))),
        None,
        E.INVALID_ARGUMENT,
        "endpoint 10.0.0.6:8998 is not this prefill engine's (10.0.0.5:8998)",
    ),
    (
        "other port",
        sgl_session(bootstrap=boot(endpoint=pb.KvEndpoint(host="10.0.0.5", port=8999))),
        None,
        E.INVALID_ARGUMENT,
        "is not this prefill engine's",
    ),
    ("missing bootstrap", sgl_session(bootstrap=None), None, E.INVALID_ARGUMENT, "bootstrap is required"),
    ("room zero", sgl_session(bootstrap=boot(room=0)), None, E.INVALID_ARGUMENT, "room_id"),
    (
        "backend mismatch",
        sgl_session(transfer_backend="nixl"),
        None,
        E.UNSUPPORTED_FEATURE,
        "transfer_backend",
    ),
    ("profile mismatch", sgl_session(handoff_profile=VLLM_PROFILE), None, E.UNSUPPORTED_FEATURE, "profile"),
    ("rank outside", sgl_session(dp_rank=2), None, E.INVALID_ARGUMENT, "dp_rank 2 is not a DP rank"),
]


@pytest.mark.parametrize(
    ("session", "target", "code", "fragment"),
    [c[1:] for c in PREFILL_CASES],
    ids=[c[0] for c in PREFILL_CASES],
)
def test_prefill_envelope(session, target, code, fragment) -> None:  # type: ignore[no-untyped-def]
    card = sglang_card(R.PREFILL)
    if code is None:
        check_prefill_session(session, card, target_dp_rank=target)
        return
    with pytest.raises(Rejection, match=re.escape(fragment)) as exc:
        check_prefill_session(session, card, target_dp_rank=target)
    assert exc.value.code == code


def test_check_bootstrap_max_room() -> None:
    check_bootstrap(boot(room=2**64 - 1))
    check_bootstrap(boot(room=1))
