"""The I/O-free core of the P/D coordinator: do two worker cards pair, and what to send each side.

Cards are the JSON form of ``sidecar.core.card.WorkerCard`` (the ``describe`` call's body,
lowerCamelCase). The coordinator (``sidecar.client.disagg``) calls:

- :func:`check_worker` — one card is usable for a side of a flow (role, problems, model,
  media of the request on the prefill/decode path);
- :func:`check_pair` — a prefill card and a decode card hand KV to each other (same handoff
  profile, transfer backend and bootstrap mode) → :class:`Pairing`;
- :func:`prefill_request` (context-first: ``max_tokens`` 1), :func:`bootstrap_session` and
  :func:`new_room` (client bootstrap), :func:`bootstrap_echoed`.

Every refusal is a :class:`PairingError` carrying the OpenEngine code a client would see from a
sidecar for the same mismatch: ``ROLE_MISMATCH`` (wrong role), ``UNSUPPORTED_FEATURE``
(connector or media mismatch: another worker may fit), ``MODEL_NOT_FOUND``, ``INTERNAL`` (a
card listing problems). Attributes of a handoff stay opaque here, as in the sidecar.
"""

from __future__ import annotations

import secrets
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import betterproto2

from sidecar.openengine import pb

__all__ = [
    "BOOTSTRAP",
    "CONTEXT_FIRST",
    "ROOM_LIMIT",
    "Pairing",
    "PairingError",
    "bootstrap_echoed",
    "bootstrap_session",
    "check_pair",
    "check_worker",
    "media_needs",
    "new_room",
    "prefill_request",
]

Mode = Literal["context_first", "bootstrap"]
CONTEXT_FIRST: Mode = "context_first"
BOOTSTRAP: Mode = "bootstrap"
#: Rooms are drawn from 1 … 2^63 - 1 (SGLang's router draws below 2^63; 0 is refused as "no room").
ROOM_LIMIT = 2**63

_MODALITY = {pb.Modality.IMAGE: "image", pb.Modality.VIDEO: "video", pb.Modality.AUDIO: "audio"}


class PairingError(Exception):
    """A worker cannot take its side of the flow, or two workers do not pair (``code``: pb.ErrorCode)."""

    def __init__(self, code: pb.ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int
    protocol: str = ""


@dataclass(frozen=True)
class Pairing:
    """How a prefill worker hands KV to a decode worker."""

    mode: Mode
    handoff_profile: str
    transfer_backend: str
    #: Client bootstrap only: the prefill's rendezvous endpoint and the DP ranks both workers serve.
    bootstrap_endpoint: Endpoint | None = None
    dp_ranks: tuple[int, ...] = (0,)


def _connector(card: Mapping[str, Any], side: str) -> Mapping[str, Any]:
    kv = card.get("kvConnector")
    if not isinstance(kv, Mapping) or kv.get("enabled") is False:
        raise PairingError(pb.ErrorCode.UNSUPPORTED_FEATURE, f"the {side} worker has no enabled KV connector")
    if not kv.get("handoffProfile"):
        raise PairingError(
            pb.ErrorCode.UNSUPPORTED_FEATURE, f"the {side} worker's KV connector names no handoff profile"
        )
    return kv


def _model(card: Mapping[str, Any], name: str, side: str) -> Mapping[str, Any]:
    models = [m for m in card.get("models") or () if isinstance(m, Mapping)]
    if not name:
        if len(models) != 1:
            raise PairingError(
                pb.ErrorCode.INVALID_ARGUMENT, f"the {side} worker serves several models: name one"
            )
        return models[0]
    for m in models:
        if m.get("servedModelName") == name or name in (m.get("aliases") or ()):
            return m
    for lora in card.get("loraAdapters") or ():
        if isinstance(lora, Mapping) and lora.get("loraName") == name:
            base = next((m for m in models if m.get("servedModelName") == lora.get("baseModel")), None)
            if base is not None:
                return base
    served = ", ".join(card.get("servedModelNames") or ()) or "none"
    raise PairingError(
        pb.ErrorCode.MODEL_NOT_FOUND, f"the {side} worker does not serve {name!r} (serves: {served})"
    )


def media_needs(request: pb.GenerateRequest) -> list[tuple[str, str]]:
    """(modality, source kind) of each media item, in order (unknown modalities as ``"unspecified"``)."""
    out = []
    for item in request.media:
        modality = _MODALITY.get(item.modality, "unspecified")
        out.append((modality, betterproto2.which_one_of(item, "source")[0] or ""))
    return out


def check_worker(
    card: Mapping[str, Any], side: Literal["prefill", "decode"], request: pb.GenerateRequest
) -> None:
    """``card`` can take the ``side`` of a flow for ``request`` (role, problems, model, P/D media)."""
    role = card.get("role")
    if role != side:
        raise PairingError(pb.ErrorCode.ROLE_MISMATCH, f"the {side} worker's role is {role!r}, not {side!r}")
    problems = card.get("problems") or ()
    if problems:
        raise PairingError(pb.ErrorCode.INTERNAL, f"the {side} worker is not servable: {'; '.join(problems)}")
    _connector(card, side)
    model = _model(card, request.model, side)
    needs = media_needs(request)
    if not needs:
        return
    name = model.get("servedModelName")
    mm = model.get("multimodal")
    if not isinstance(mm, Mapping):
        if model.get("supportsMultimodal") is True:
            return  # a revision-1 engine: no per-path lists; the sidecar and engine decide
        raise PairingError(
            pb.ErrorCode.UNSUPPORTED_FEATURE, f"model {name!r} on the {side} worker takes no media"
        )
    accepted = mm.get("prefillDecodeModalities") or []
    sources = mm.get("sourceTypes") or []
    for i, (modality, source) in enumerate(needs):
        if modality not in accepted:
            raise PairingError(
                pb.ErrorCode.UNSUPPORTED_FEATURE,
                f"media[{i}]: {modality} is not accepted on the prefill/decode path of the {side} worker "
                f"(accepted: {', '.join(accepted) or 'none'})",
            )
        if source and source not in sources:
            raise PairingError(
                pb.ErrorCode.UNSUPPORTED_FEATURE,
                f"media[{i}]: source {source} is not accepted by the {side} worker "
                f"(source types: {', '.join(sources) or 'none'})",
            )


def _endpoint(value: Any) -> Endpoint | None:
    if not isinstance(value, Mapping) or not value.get("host") or not value.get("port"):
        return None
    return Endpoint(str(value["host"]), int(value["port"]), str(value.get("protocol") or ""))


def check_pair(prefill: Mapping[str, Any], decode: Mapping[str, Any]) -> Pairing:
    """The prefill card's connector hands KV to the decode card's: same handoff profile,
    transfer backend (case-insensitive; empty matches) and bootstrap mode. Client bootstrap
    also needs the prefill's rendezvous endpoint and a DP rank both serve."""
    pk, dk = _connector(prefill, "prefill"), _connector(decode, "decode")
    profile = str(pk["handoffProfile"])
    if dk["handoffProfile"] != profile:
        raise PairingError(
            pb.ErrorCode.UNSUPPORTED_FEATURE,
            f"handoff profiles differ: prefill {profile!r}, decode {dk['handoffProfile']!r}",
        )
    pb_, db = str(pk.get("transferBackend") or ""), str(dk.get("transferBackend") or "")
    if pb_ and db and pb_.casefold() != db.casefold():
        raise PairingError(
            pb.ErrorCode.UNSUPPORTED_FEATURE, f"transfer backends differ: prefill {pb_!r}, decode {db!r}"
        )
    p_boot, d_boot = pk.get("supportsClientBootstrap") is True, dk.get("supportsClientBootstrap") is True
    if p_boot != d_boot:
        raise PairingError(
            pb.ErrorCode.UNSUPPORTED_FEATURE,
            f"one worker uses client bootstrap and the other does not (prefill {p_boot}, decode {d_boot})",
        )
    if not p_boot:
        return Pairing(CONTEXT_FIRST, profile, pb_ or db)
    endpoint = _endpoint(pk.get("bootstrapEndpoint")) or next(
        (e for e in map(_endpoint, pk.get("localEndpoints") or ()) if e is not None), None
    )
    if endpoint is None:
        raise PairingError(
            pb.ErrorCode.UNSUPPORTED_FEATURE, "the prefill worker advertises no bootstrap endpoint"
        )
    common = sorted(set(prefill.get("dpRanks") or [0]) & set(decode.get("dpRanks") or [0]))
    if not common:
        raise PairingError(
            pb.ErrorCode.UNSUPPORTED_FEATURE, "the prefill and decode workers share no DP rank"
        )
    return Pairing(BOOTSTRAP, profile, pb_ or db, endpoint, tuple(common))


def prefill_request(request: pb.GenerateRequest) -> pb.GenerateRequest:
    """Context-first prefill: the request with ``max_tokens`` 1 (and no ``min_tokens``); a copy."""
    out = pb.GenerateRequest.parse(bytes(request))
    stopping = out.stopping or pb.StoppingOptions()
    stopping.max_tokens = 1
    stopping.min_tokens = None
    out.stopping = stopping
    return out


def new_room(in_flight: Collection[int]) -> int:
    """A random bootstrap room in 1 … 2^63 - 1, not in ``in_flight``."""
    while True:
        room = secrets.randbelow(ROOM_LIMIT - 1) + 1
        if room not in in_flight:
            return room


def bootstrap_session(pairing: Pairing, room: int, target_dp_rank: str | None = None) -> bytes:
    """The ``KvSessionRef`` (protobuf bytes) both requests of a client-bootstrap flow carry.

    Its ``dp_rank`` is the request's ``openengine-target-dp-rank`` when both workers serve
    that rank (a session rank that disagrees with the key is refused), else the lowest
    rank both serve.
    """
    ep = pairing.bootstrap_endpoint
    assert ep is not None, "client bootstrap pairing without an endpoint"
    rank = pairing.dp_ranks[0]
    if target_dp_rank is not None and target_dp_rank.isdigit() and int(target_dp_rank) in pairing.dp_ranks:
        rank = int(target_dp_rank)
    return bytes(
        pb.KvSessionRef(
            transfer_backend=pairing.transfer_backend,
            dp_rank=rank,
            handoff_profile=pairing.handoff_profile,
            bootstrap=pb.KvBootstrap(
                endpoint=pb.KvEndpoint(host=ep.host, port=ep.port, protocol=ep.protocol), room_id=room
            ),
        )
    )


def bootstrap_echoed(sent: bytes, ready: bytes | None) -> str | None:
    """``None`` when the prefill's ``PrefillReady`` session (``ready``, its bytes) carries the
    bootstrap that was ``sent`` (room and endpoint host/port); else why not."""
    if not ready:
        return "prefillReady carried no KV session"
    try:
        got = pb.KvSessionRef.parse(ready).bootstrap
    except Exception as err:  # betterproto2 raises assorted errors on malformed bytes
        return f"prefillReady's KV session is unreadable ({type(err).__name__})"
    want = pb.KvSessionRef.parse(sent).bootstrap
    assert want is not None and want.endpoint is not None
    if got is None or got.endpoint is None:
        return "prefillReady's KV session has no bootstrap"
    if got.room_id != want.room_id:
        return f"prefillReady echoes room {got.room_id}, not {want.room_id}"
    if (got.endpoint.host.casefold(), got.endpoint.port) != (
        want.endpoint.host.casefold(),
        want.endpoint.port,
    ):
        return (
            f"prefillReady echoes bootstrap endpoint {got.endpoint.host}:{got.endpoint.port}, "
            f"not {want.endpoint.host}:{want.endpoint.port}"
        )
    return None
