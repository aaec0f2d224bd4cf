"""The P/D coordinator's I/O-free core (``sidecar.client.disagg_pairing``), on real worker cards.

The cards are built the way a sidecar builds them (``build_card``) from the simulated
engines' discovery answers, so they carry every field a real ``describe`` returns.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from sidecar.client.disagg_pairing import (
    BOOTSTRAP,
    CONTEXT_FIRST,
    ROOM_LIMIT,
    PairingError,
    bootstrap_echoed,
    bootstrap_session,
    check_pair,
    check_worker,
    media_needs,
    new_room,
    prefill_request,
)
from sidecar.core.card import build_card, card_to_json
from sidecar.core.negotiation import negotiate
from sidecar.mock import flavors
from sidecar.mock.config import EngineConfig
from sidecar.openengine import pb

MODEL = "Qwen/Qwen3-0.6B"


def card(flavor: str, role: str, *, dp_size: int = 1, port: int = 7000, **changes: Any) -> dict[str, Any]:
    cfg = EngineConfig(flavor=flavor, role=role, dp_size=dp_size)  # type: ignore[arg-type]
    endpoints = [pb.KvEndpoint(host="10.0.0.5", port=port, protocol="tcp")]
    info = flavors.server_info(cfg, instance=f"{flavor}-{role}", endpoints=endpoints)
    built = build_card(info, negotiate(info), {MODEL: flavors.model_info(cfg)})
    out: dict[str, Any] = json.loads(card_to_json(built))
    for path, value in changes.items():
        target = out
        *parents, leaf = path.split("__")
        for p in parents:
            target = target[p]
        target[leaf] = value
    return out


def request(**fields: Any) -> pb.GenerateRequest:
    return pb.GenerateRequest(**{"model": MODEL, "prompt": "hi", **fields})


def media(*items: tuple[pb.Modality, str]) -> list[pb.MediaItem]:
    out = []
    for modality, source in items:
        value: Any = (
            b"\x01"
            if source == "raw_bytes"
            else "data:image/png;base64,AA=="
            if source == "data_uri"
            else "http://x/m"
        )
        out.append(pb.MediaItem(modality=modality, **{source: value}))
    return out


@pytest.mark.parametrize("flavor", ["vllm", "trtllm"])
def test_context_first_pairs(flavor: str) -> None:
    pairing = check_pair(card(flavor, "prefill"), card(flavor, "decode"))
    assert pairing.mode == CONTEXT_FIRST and pairing.bootstrap_endpoint is None
    assert pairing.handoff_profile == flavors.FLAVORS[flavor].handoff_profile


def test_bootstrap_pairs_with_the_prefill_endpoint_and_a_common_rank() -> None:
    pairing = check_pair(card("sglang", "prefill", port=7111), card("sglang", "decode", dpRanks=[0, 1]))
    assert pairing.mode == BOOTSTRAP and pairing.dp_ranks == (0,)
    assert pairing.bootstrap_endpoint is not None
    assert (pairing.bootstrap_endpoint.host, pairing.bootstrap_endpoint.port) == ("10.0.0.5", 7111)
    # no bootstrapEndpoint in the card: the first local endpoint
    pairing = check_pair(
        card("sglang", "prefill", kvConnector__bootstrapEndpoint=None), card("sglang", "decode")
    )
    assert pairing.bootstrap_endpoint is not None and pairing.bootstrap_endpoint.port == 7000
    with pytest.raises(PairingError, match="share no DP rank"):
        check_pair(card("sglang", "prefill", dpRanks=[2, 3]), card("sglang", "decode"))
    with pytest.raises(PairingError, match="no bootstrap endpoint"):
        check_pair(
            card("sglang", "prefill", kvConnector__bootstrapEndpoint=None, kvConnector__localEndpoints=[]),
            card("sglang", "decode"),
        )


@pytest.mark.parametrize(
    ("prefill", "decode", "match"),
    [
        (card("vllm", "prefill"), card("trtllm", "decode"), "handoff profiles differ"),
        (
            card("vllm", "prefill"),
            card("vllm", "decode", kvConnector__transferBackend="ucx"),
            "transfer backends",
        ),
        (
            card("sglang", "prefill"),
            card("sglang", "decode", kvConnector__supportsClientBootstrap=False),
            "bootstrap",
        ),
        (
            card("vllm", "prefill"),
            card("vllm", "decode", kvConnector__enabled=False),
            "no enabled KV connector",
        ),
    ],
)
def test_unpaired_connectors(prefill: dict[str, Any], decode: dict[str, Any], match: str) -> None:
    with pytest.raises(PairingError, match=match) as info:
        check_pair(prefill, decode)
    assert info.value.code == pb.ErrorCode.UNSUPPORTED_FEATURE


def test_backend_case_and_absence_are_tolerated() -> None:
    check_pair(card("vllm", "prefill"), card("vllm", "decode", kvConnector__transferBackend="NIXL"))
    check_pair(card("vllm", "prefill", kvConnector__transferBackend=""), card("vllm", "decode"))


def test_worker_role_problems_and_model() -> None:
    check_worker(card("vllm", "prefill"), "prefill", request())
    with pytest.raises(PairingError) as info:
        check_worker(card("vllm", "aggregated"), "prefill", request())
    assert info.value.code == pb.ErrorCode.ROLE_MISMATCH
    with pytest.raises(PairingError) as info:
        check_worker(card("vllm", "prefill"), "decode", request())
    assert info.value.code == pb.ErrorCode.ROLE_MISMATCH
    with pytest.raises(PairingError) as info:
        check_worker(card("vllm", "decode", problems=["bad"]), "decode", request())
    assert info.value.code == pb.ErrorCode.INTERNAL
    with pytest.raises(PairingError) as info:
        check_worker(card("vllm", "decode"), "decode", request(model="other"))
    assert info.value.code == pb.ErrorCode.MODEL_NOT_FOUND
    check_worker(card("vllm", "decode"), "decode", pb.GenerateRequest(prompt="no model: the only one"))
    lora = {"loraId": 1, "loraName": "sql", "sourcePath": "/l/sql", "baseModel": MODEL}
    check_worker(card("vllm", "decode", loraAdapters=[lora]), "decode", request(model="sql"))


MEDIA_MATRIX = [
    # flavour, media, accepted on the P/D path
    ("trtllm", [(pb.Modality.IMAGE, "url"), (pb.Modality.VIDEO, "data_uri")], True),
    ("trtllm", [(pb.Modality.IMAGE, "url"), (pb.Modality.AUDIO, "url")], False),  # audio: aggregated only
    ("vllm", [(pb.Modality.IMAGE, "url")], True),
    ("vllm", [(pb.Modality.VIDEO, "url")], False),
    ("vllm", [(pb.Modality.IMAGE, "raw_bytes")], False),  # source type not advertised
    ("sglang", [(pb.Modality.VIDEO, "raw_bytes"), (pb.Modality.IMAGE, "url")], True),
    ("sglang", [(pb.Modality.AUDIO, "raw_bytes")], False),
]


@pytest.mark.parametrize(("flavor", "items", "accepted"), MEDIA_MATRIX)
def test_media_on_the_prefill_decode_path(flavor: str, items: list[Any], accepted: bool) -> None:
    req = request(media=media(*items))
    for role in ("prefill", "decode"):
        if accepted:
            check_worker(card(flavor, role), role, req)  # type: ignore[arg-type]
        else:
            with pytest.raises(PairingError) as info:
                check_worker(card(flavor, role), role, req)  # type: ignore[arg-type]
            assert info.value.code == pb.ErrorCode.UNSUPPORTED_FEATURE


def test_media_needs_keeps_order() -> None:
    req = request(media=media((pb.Modality.VIDEO, "url"), (pb.Modality.IMAGE, "raw_bytes")))
    assert media_needs(req) == [("video", "url"), ("image", "raw_bytes")]
    assert media_needs(request(media=[pb.MediaItem(url="http://x")])) == [("unspecified", "url")]


def test_prefill_request_is_one_token_and_a_copy() -> None:
    original = request(stopping=pb.StoppingOptions(max_tokens=64, min_tokens=8, ignore_eos=True))
    pre = prefill_request(original)
    assert pre.stopping is not None and pre.stopping.max_tokens == 1 and pre.stopping.min_tokens is None
    assert pre.stopping.ignore_eos is True and pre.prompt == "hi"
    assert original.stopping is not None and original.stopping.max_tokens == 64  # untouched
    assert prefill_request(request()).stopping == pb.StoppingOptions(max_tokens=1)


def test_rooms_are_random_nonzero_63_bit_and_avoid_rooms_in_flight() -> None:
    rooms = {new_room(()) for _ in range(200)}
    assert len(rooms) == 200 and all(0 < r < ROOM_LIMIT for r in rooms)
    assert max(rooms) > 2**53  # not squeezed into a double's range

    taken = {1, 2, 3}
    import sidecar.client.disagg_pairing as mod

    draws = iter([0, 1, 2, 41])  # randbelow -> room = draw + 1
    original = mod.secrets.randbelow
    mod.secrets.randbelow = lambda _n: next(draws)  # type: ignore[assignment]
    try:
        assert new_room(taken) == 42
    finally:
        mod.secrets.randbelow = original


def test_bootstrap_session_and_its_echo() -> None:
    pairing = check_pair(card("sglang", "prefill", port=7111), card("sglang", "decode"))
    sent = bootstrap_session(pairing, 2**62 + 5)
    ref = pb.KvSessionRef.parse(sent)
    assert ref.handoff_profile == "sglang.bootstrap.v1" and ref.transfer_backend == "mooncake"
    assert ref.bootstrap is not None and ref.bootstrap.room_id == 2**62 + 5
    assert ref.bootstrap.endpoint == pb.KvEndpoint(host="10.0.0.5", port=7111, protocol="tcp")
    assert ref.dp_rank == 0

    two = check_pair(card("sglang", "prefill", dp_size=2), card("sglang", "decode", dp_size=4))
    assert two.dp_ranks == (0, 1)
    assert pb.KvSessionRef.parse(bootstrap_session(two, 9, "1")).dp_rank == 1  # the target rank
    assert (
        pb.KvSessionRef.parse(bootstrap_session(two, 9, "3")).dp_rank == 0
    )  # not common: the sidecar decides

    echoed = pb.KvSessionRef(
        session_id="s", handoff_profile="sglang.bootstrap.v1", bootstrap=ref.bootstrap, dp_rank=0
    )
    assert bootstrap_echoed(sent, bytes(echoed)) is None
    wrong_room = pb.KvSessionRef(
        bootstrap=pb.KvBootstrap(endpoint=ref.bootstrap.endpoint, room_id=7), handoff_profile="x"
    )
    assert "room 7" in (bootstrap_echoed(sent, bytes(wrong_room)) or "")
    wrong_host = pb.KvSessionRef(
        bootstrap=pb.KvBootstrap(endpoint=pb.KvEndpoint(host="10.0.0.6", port=7111), room_id=2**62 + 5)
    )
    assert "endpoint" in (bootstrap_echoed(sent, bytes(wrong_host)) or "")
    assert "no bootstrap" in (bootstrap_echoed(sent, bytes(pb.KvSessionRef(session_id="s"))) or "")
    assert bootstrap_echoed(sent, None) is not None
