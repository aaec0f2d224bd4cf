"""The handoff profile of a P/D engine that advertises none (docs/COMPATIBILITY.md, "Legacy P/D").

Schemas without ``KvConnectorInfo.handoff_profile`` (4def7c5 and older) still hand KV over
the engine's own way; the profile only names that contract. :func:`derive_profile` names it
from what such an engine does advertise — its engine name and KV transfer backend —
using one table row per engine, and only for backends known to carry that engine's
contract. Anything else derives nothing (the operator sets ``--handoff-profile``, or the
engine is refused). :func:`effective_profile` combines the advertised, configured and
derived profile into what the worker card uses.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "DERIVATIONS",
    "PROFILE_PATTERN",
    "Derivation",
    "ProfileChoice",
    "derive_profile",
    "effective_profile",
    "parse_profile",
]

#: A handoff profile name: dotted lower-case words ending in a version (``vllm.kv_transfer_params.v1``).
PROFILE_PATTERN = re.compile(r"[a-z0-9_]+(?:\.[a-z0-9_]+)*\.v[0-9]+")

ProfileSource = Literal["advertised", "configured", "derived"]


@dataclass(frozen=True)
class Derivation:
    """How one engine hands KV over, whichever transfer backend moves the bytes."""

    #: ``ServerInfo.engine_name`` values (compared case-insensitively, ``-`` = ``_``).
    engine_names: tuple[str, ...]
    profile: str
    #: ``KvConnectorInfo.transfer_backend`` values that carry this contract (lower case).
    backends: frozenset[str]


DERIVATIONS: tuple[Derivation, ...] = (
    # vLLM: the NixlConnector's kv_transfer_params (remote_engine_id, remote_block_ids, ...).
    Derivation(("vllm",), "vllm.kv_transfer_params.v1", frozenset({"nixl"})),
    # TensorRT-LLM: disaggregated_params (ctx_request_id, encoded_opaque_state, ...); the cache
    # transceiver backend (UCX, NIXL or MPI) does not change them.
    Derivation(
        ("tensorrt_llm", "trtllm"), "tensorrt_llm.disaggregated_params.v1", frozenset({"ucx", "nixl", "mpi"})
    ),
    # SGLang: bootstrap host / port / room; without the schema's client bootstrap fields the
    # prefill chooses the room and returns it in PrefillReady (context-first).
    Derivation(("sglang",), "sglang.bootstrap.v1", frozenset({"mooncake", "nixl"})),
)


def _norm(name: str) -> str:
    return name.strip().casefold().replace("-", "_")


def derive_profile(engine_name: str, transfer_backend: str) -> str | None:
    """The profile of ``engine_name`` over ``transfer_backend``, or ``None`` when the table has none."""
    backend = transfer_backend.strip().casefold()
    for d in DERIVATIONS:
        if _norm(engine_name) in d.engine_names and backend in d.backends:
            return d.profile
    return None


def parse_profile(value: str) -> str:
    """Validate an operator's ``--handoff-profile``; ``ValueError`` if it is not a profile name."""
    value = value.strip()
    if not PROFILE_PATTERN.fullmatch(value):
        raise ValueError(
            f"{value!r} is not a handoff profile name (dotted lower-case words ending in a "
            "version, e.g. vllm.kv_transfer_params.v1)"
        )
    return value


@dataclass(frozen=True)
class ProfileChoice:
    """What the card uses: the profile (``""`` if none), where it came from, and a WARNING or a problem."""

    profile: str
    source: ProfileSource | None
    warning: str | None = None
    problem: str | None = None


def effective_profile(
    role: str, engine_name: str, advertised: str, transfer_backend: str, configured: str | None
) -> ProfileChoice:
    """Advertised wins (a different ``configured`` one is a problem); else configured; else derived."""
    if advertised:
        if configured is not None and configured != advertised:
            return ProfileChoice(
                advertised,
                "advertised",
                problem=f"--handoff-profile {configured} contradicts the {role} engine's advertised "
                f"handoff_profile {advertised}",
            )
        return ProfileChoice(advertised, "advertised")
    if configured is not None:
        return ProfileChoice(
            configured,
            "configured",
            warning=f"{role} engine {engine_name} advertises no handoff_profile; using --handoff-profile "
            f"{configured}",
        )
    derived = derive_profile(engine_name, transfer_backend)
    if derived is not None:
        return ProfileChoice(
            derived,
            "derived",
            warning=f"{role} engine {engine_name} advertises no handoff_profile (an older schema); derived "
            f"{derived} from engine {engine_name} and transfer backend {transfer_backend} "
            "(docs/COMPATIBILITY.md; --handoff-profile sets it)",
        )
    return ProfileChoice(
        "",
        None,
        problem=f"{role} engine's KV connector advertises no handoff_profile and none derives from engine "
        f"{engine_name or '(unnamed)'} with transfer backend {transfer_backend or '(none)'} "
        "(docs/COMPATIBILITY.md); set --handoff-profile",
    )
