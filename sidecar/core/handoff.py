"""Envelope checks of a ``KvSessionRef`` before it reaches the engine (P/D handoff).

The attributes (``attributes_struct``) stay opaque: only the envelope is checked,
against this worker's card. Codes:

- ``UNSUPPORTED_FEATURE``: the session was made for another connector (its
  ``handoff_profile`` or ``transfer_backend`` differs from this worker's), or this
  worker has no enabled KV connector. Another worker may take it.
- ``INVALID_ARGUMENT``: a malformed or inconsistent envelope: no profile on a
  context-first handoff, ``dp_rank`` outside this worker's DP ranks, a conflicting
  ``openengine-target-dp-rank`` (the engine would answer the same), a bootstrap
  present on a context-first connector or missing on a client-bootstrap one, room 0,
  no/invalid bootstrap endpoint, a prefill bootstrap endpoint that is not this
  engine's.

Decisions where the schema is silent:

- An empty ``transfer_backend`` in the session is accepted (not every engine sets
  it); a non-empty one must equal the connector's (case-insensitive).
- An empty ``handoff_profile`` is accepted on client-bootstrap connectors, where
  the client (not an engine) builds the session, and on connectors whose profile was
  derived or configured (an older schema without the field: its prefill engines cannot
  name it); otherwise a context-first session comes from a prefill engine's
  ``PrefillReady`` and must name its profile. A named profile must always match.
- On a client-bootstrap prefill, the bootstrap endpoint must be one of this engine's
  ``kv_connector.local_endpoints`` (host and port): a misrouted prefill would
  otherwise wait in "bootstrapping" until SGLang's timeout.

Role rules (which role needs a session at all) live in ``admission.py``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from sidecar.core.card import KvConnectorCard, WorkerCard
from sidecar.core.errors import invalid_argument, unsupported
from sidecar.openengine import pb
from sidecar.openengine.schema._betterproto2_internals import set_unknown_fields
from sidecar.openengine.schema.protobuf_wire import length_delimited, parse_strict
from sidecar.quoting import quote

__all__ = [
    "KNOWN_HANDOFF_PROFILES",
    "KvSessionRelease",
    "abort_kv_session_bytes",
    "check_bootstrap",
    "check_decode_session",
    "check_prefill_session",
    "parse_kv_session",
    "splice_kv_session",
]

KNOWN_HANDOFF_PROFILES = frozenset(
    {"vllm.kv_transfer_params.v1", "tensorrt_llm.disaggregated_params.v1", "sglang.bootstrap.v1"}
)


@dataclass(slots=True, frozen=True)
class KvSessionRelease:
    """A client's request to release a prefill engine's KV session (north call
    ``releaseKvSession``): the ``KvSessionRef`` bytes exactly as the client got them in
    ``prefillReady`` and their parsed view. The engine gets ``Abort{kv_session}`` carrying
    those bytes unchanged (:func:`abort_kv_session_bytes`)."""

    raw: bytes
    session: pb.KvSessionRef


def abort_kv_session_bytes(raw: bytes) -> bytes:
    """A serialized ``AbortRequest{kv_session}`` whose session is ``raw`` byte for byte."""
    return length_delimited(2, raw)  # field 2: kv_session


def parse_kv_session(raw: bytes) -> pb.KvSessionRef:
    """Check ``raw`` is a well-formed ``KvSessionRef`` (framing, known fields' wire types, UTF-8
    strings) and return its parsed form (for the envelope checks). Unknown fields are kept, so
    ``bytes(result)`` carries them on. Raises ``WireError`` (a ``ValueError``): betterproto2's own
    parser accepts malformed input silently. Empty and oversized bytes are the caller's to refuse
    (each plane bounds what its clients send)."""
    return parse_strict(pb.KvSessionRef, raw)


def splice_kv_session(request: pb.GenerateRequest, raw: bytes | None) -> pb.GenerateRequest:
    """A shallow copy of ``request`` whose ``kv.session`` is ``raw``, byte for byte (``request``
    itself when ``raw`` is None).

    The decode engine must receive the prefill engine's ``KvSessionRef`` exactly as produced --
    field order, unknown fields (a newer schema revision) and all; re-serializing a parsed copy
    would not guarantee that. The bytes become field 1 (``session``) of ``KvOptions``, held in
    that message's unknown-field buffer: ``bytes()`` emits them untouched after the other
    ``KvOptions`` fields, as a single occurrence of the field (no reliance on protobuf's merging
    of repeated message fields). ``request`` itself is not modified.
    """
    if raw is None:
        return request
    out = copy.copy(request)
    kv = copy.copy(request.kv) if request.kv is not None else pb.KvOptions()
    kv.session = None
    set_unknown_fields(kv, length_delimited(1, raw))  # field 1 (session)
    out.kv = kv
    return out


def check_bootstrap(bootstrap: pb.KvBootstrap) -> None:
    """Room non-zero, endpoint with a host and a port in 1…65535."""
    if bootstrap.room_id == 0:
        invalid_argument("kv.session.bootstrap.room_id must be non-zero")
    ep = bootstrap.endpoint
    if ep is None or not ep.host:
        invalid_argument("kv.session.bootstrap has no endpoint host")
    if not 0 < ep.port <= 65535:
        invalid_argument(f"kv.session.bootstrap endpoint port {ep.port} is out of range")


def _connector(card: WorkerCard) -> KvConnectorCard:
    kv = card.kv_connector
    if kv is None or kv.enabled is False:
        unsupported(f"this {card.role} worker has no enabled KV connector")
    return kv


def _check_profile_backend(session: pb.KvSessionRef, kv: KvConnectorCard, *, require_profile: bool) -> None:
    profile = session.handoff_profile
    if not profile:
        if require_profile:
            invalid_argument("kv.session has no handoff_profile")
    elif profile != kv.handoff_profile:
        unsupported(
            f"kv.session handoff_profile {quote(profile)} does not match this worker's connector "
            f"({kv.handoff_profile!r})"
        )
    backend = session.transfer_backend
    if backend and kv.transfer_backend and backend.casefold() != kv.transfer_backend.casefold():
        unsupported(
            f"kv.session transfer_backend {quote(backend)} does not match this worker's connector "
            f"({kv.transfer_backend!r})"
        )


def _check_rank(session: pb.KvSessionRef, card: WorkerCard, target_dp_rank: int | None) -> None:
    rank = int(session.dp_rank)
    if rank not in card.dp_ranks:
        ranks = ", ".join(map(str, card.dp_ranks))
        invalid_argument(f"kv.session dp_rank {rank} is not a DP rank of this worker ({ranks})")
    if target_dp_rank is not None and target_dp_rank != rank:
        invalid_argument(
            f"openengine-target-dp-rank {target_dp_rank} conflicts with kv.session dp_rank {rank}"
        )


def check_decode_session(
    session: pb.KvSessionRef, card: WorkerCard, *, target_dp_rank: int | None = None
) -> None:
    """Envelope of the session a decode request carries (from ``PrefillReady`` or the P/D client)."""
    kv = _connector(card)
    bootstrap_mode = kv.uses_client_bootstrap
    _check_profile_backend(session, kv, require_profile=not bootstrap_mode and kv.requires_session_profile)
    _check_rank(session, card, target_dp_rank)
    if bootstrap_mode:
        if session.bootstrap is None:
            invalid_argument("this decode worker uses client bootstrap: kv.session.bootstrap is required")
        check_bootstrap(session.bootstrap)
    elif session.bootstrap is not None:
        invalid_argument(
            "kv.session.bootstrap given, but this worker's connector does not use client bootstrap"
        )


def check_prefill_session(
    session: pb.KvSessionRef, card: WorkerCard, *, target_dp_rank: int | None = None
) -> None:
    """Envelope of the bootstrap session a client-bootstrap prefill request carries."""
    kv = _connector(card)
    _check_profile_backend(session, kv, require_profile=False)
    _check_rank(session, card, target_dp_rank)
    if session.bootstrap is None:
        invalid_argument("this prefill worker uses client bootstrap: kv.session.bootstrap is required")
    check_bootstrap(session.bootstrap)
    ep = session.bootstrap.endpoint
    assert ep is not None  # check_bootstrap
    if kv.local_endpoints and not any(e.same_address(ep.host, int(ep.port)) for e in kv.local_endpoints):
        mine = ", ".join(f"{e.host}:{e.port}" for e in kv.local_endpoints)
        invalid_argument(
            f"kv.session.bootstrap endpoint {ep.host}:{ep.port} is not this prefill engine's ({mine})"
        )
