"""Validation of the gRPC request metadata a client asks us to forward (the schema's api.md, "gRPC request metadata").

Policy (every violation is ``ERROR_CODE_INVALID_ARGUMENT``; nothing reaches the engine):

- Keys are ASCII gRPC keys (``0-9 a-z _ . -``). Upper-case letters are folded to lower
  case (gRPC keys are case-insensitive on HTTP/2); after folding, a key may appear once.
- ``openengine-routing-key``: non-empty printable ASCII, forwarded unchanged.
- ``openengine-target-dp-rank``: base-10 ``uint32`` (digits only) and one of this
  worker's DP ranks; forwarded in canonical form (``"007"`` → ``"7"``).
- ``openengine-priority``: base-10 ``int32`` (optional ``-``); canonical form.
  Whether the model supports priority is an admission question (``admission.py``).
- ``traceparent``: W3C Trace Context (version ``ff`` invalid, version ``00`` exactly
  4 fields, trace-id and parent-id not all zeros). ``tracestate``: W3C list syntax,
  at most 32 members, unique keys, and only together with a ``traceparent``.
  Malformed trace context is rejected rather than dropped, so a client bug shows.
- Every other ``openengine-*`` key is rejected (the prefix is reserved by the protocol).
- Application keys (any other well-formed key) are forwarded unchanged, as the schema
  allows ("Application-specific metadata may use other gRPC metadata keys"), unless
  ``allow_application_keys=False``. Never forwarded: ``grpc-*`` (gRPC's own), binary
  ``*-bin`` keys, HTTP/2 connection headers (``te``, ``content-type``, ``host``, …).
- Values are printable ASCII (gRPC non-binary metadata); bounded sizes (64 keys, 4 KiB
  per value, 8 KiB in all) keep the engine's header limits out of reach.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from sidecar.core.errors import invalid_argument
from sidecar.quoting import quote

__all__ = [
    "OPENENGINE_KEYS",
    "PRIORITY",
    "ROUTING_KEY",
    "TARGET_DP_RANK",
    "TRACEPARENT",
    "TRACESTATE",
    "NormalizedMetadata",
    "normalize_metadata",
    "valid_traceparent",
    "valid_tracestate",
]

ROUTING_KEY = "openengine-routing-key"
TARGET_DP_RANK = "openengine-target-dp-rank"
PRIORITY = "openengine-priority"
TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
OPENENGINE_KEYS = frozenset({ROUTING_KEY, TARGET_DP_RANK, PRIORITY, TRACEPARENT, TRACESTATE})

MAX_KEYS = 64
MAX_VALUE_LEN = 4096
MAX_TOTAL_LEN = 8192
UINT32_MAX = 2**32 - 1
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1

_KEY = re.compile(r"[0-9a-z_.\-]+")
_PRINTABLE = re.compile(r"[\x20-\x7e]*")
_UINT = re.compile(r"[0-9]{1,20}")  # digits bounded before int() (Python refuses > 4,300)
_INT = re.compile(r"-?[0-9]{1,20}")
_RESERVED = frozenset(
    {
        "te",
        "content-type",
        "content-length",
        "user-agent",
        "host",
        "connection",
        "keep-alive",
        "proxy-connection",
        "transfer-encoding",
        "upgrade",
    }
)
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")
_TS_KEY = re.compile(r"[a-z][a-z0-9_\-*/]{0,255}|[a-z0-9][a-z0-9_\-*/]{0,240}@[a-z][a-z0-9_\-*/]{0,13}")
_TS_VALUE = re.compile(r"[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e]")


@dataclass(frozen=True)
class NormalizedMetadata:
    """Validated metadata: the pairs to send as gRPC metadata plus the parsed OpenEngine keys."""

    pairs: tuple[tuple[str, str], ...] = ()
    routing_key: str | None = None
    target_dp_rank: int | None = None
    priority: int | None = None
    traceparent: str | None = None
    tracestate: str | None = None
    application_keys: tuple[str, ...] = field(default=())

    def as_dict(self) -> dict[str, str]:
        """The pairs as a mapping (each key appears once), for ``EngineClient`` calls."""
        return dict(self.pairs)


#: What no metadata normalizes to (immutable: shared by every request that has none).
_NO_METADATA = NormalizedMetadata()


def valid_traceparent(value: str) -> bool:
    """W3C Trace Context ``traceparent`` check (level 1, forward-compatible versions)."""
    m = _TRACEPARENT.fullmatch(value)
    if m is None:
        return False
    version, trace_id, parent_id, _flags, rest = m.groups()
    if version == "ff":
        return False
    if version == "00" and rest is not None:
        return False
    return trace_id != "0" * 32 and parent_id != "0" * 16


def valid_tracestate(value: str) -> bool:
    """W3C ``tracestate``: comma-separated ``key=value`` members, <= 32, unique keys."""
    keys: set[str] = set()
    for raw in value.split(","):
        member = raw.strip(" \t")
        if not member:
            continue
        key, sep, val = member.partition("=")
        if not sep or not _TS_KEY.fullmatch(key) or not _TS_VALUE.fullmatch(val) or key in keys:
            return False
        keys.add(key)
    return len(keys) <= 32


def _items(metadata: Mapping[str, str] | Iterable[tuple[str, str]] | None) -> list[tuple[object, object]]:
    if metadata is None:
        return []
    if isinstance(metadata, Mapping):
        return list(metadata.items())
    return [tuple(kv) for kv in metadata]  # type: ignore[misc]


def normalize_metadata(
    metadata: Mapping[str, str] | Iterable[tuple[str, str]] | None,
    *,
    dp_ranks: Sequence[int] | None = None,
    allow_application_keys: bool = True,
) -> NormalizedMetadata:
    """Validate client metadata; raise :class:`~sidecar.core.errors.Rejection` (INVALID_ARGUMENT).

    ``dp_ranks`` are this worker's ranks (``WorkerCard.dp_ranks``); ``None`` skips the
    membership check of ``openengine-target-dp-rank``.
    """
    if not metadata:
        return _NO_METADATA
    items = _items(metadata)
    if len(items) > MAX_KEYS:
        invalid_argument(f"too many metadata keys ({len(items)} > {MAX_KEYS})")
    out: list[tuple[str, str]] = []
    seen: set[str] = set()
    parsed: dict[str, object] = {}
    apps: list[str] = []
    total = 0
    for raw_key, value in items:
        if not isinstance(raw_key, str) or not raw_key.isascii():
            invalid_argument(f"metadata key {quote(raw_key)} is not an ASCII string")
        key = raw_key.lower()
        if not _KEY.fullmatch(key):
            invalid_argument(f"metadata key {quote(raw_key)} is not a valid gRPC key (0-9 a-z _ . -)")
        if key in seen:
            invalid_argument(f"metadata key {quote(key)} is given more than once")
        seen.add(key)
        if not isinstance(value, str):
            invalid_argument(f"metadata value of {quote(key)} must be a string")
        if len(value) > MAX_VALUE_LEN:
            invalid_argument(f"metadata value of {quote(key)} is longer than {MAX_VALUE_LEN} characters")
        if not _PRINTABLE.fullmatch(value):
            invalid_argument(f"metadata value of {quote(key)} is not printable ASCII")
        total += len(key) + len(value)
        if total > MAX_TOTAL_LEN:
            invalid_argument(f"metadata is larger than {MAX_TOTAL_LEN} bytes")

        if key == ROUTING_KEY:
            if not value:
                invalid_argument(f"{ROUTING_KEY} must not be empty")
        elif key == TARGET_DP_RANK:
            if not _UINT.fullmatch(value) or int(value) > UINT32_MAX:
                invalid_argument(f"{TARGET_DP_RANK} {quote(value)} is not a base-10 uint32")
            rank = int(value)
            if dp_ranks is not None and rank not in dp_ranks:
                ranks = ", ".join(map(str, dp_ranks))
                invalid_argument(f"{TARGET_DP_RANK} {rank} is not a DP rank of this worker ({ranks})")
            value = str(rank)
            parsed[key] = rank
        elif key == PRIORITY:
            if not _INT.fullmatch(value) or not INT32_MIN <= int(value) <= INT32_MAX:
                invalid_argument(f"{PRIORITY} {quote(value)} is not a base-10 int32")
            value = str(int(value))
            parsed[key] = int(value)
        elif key == TRACEPARENT:
            if not valid_traceparent(value):
                invalid_argument(f"traceparent {quote(value)} is not a valid W3C traceparent")
        elif key == TRACESTATE:
            if not valid_tracestate(value):
                invalid_argument("tracestate is not a valid W3C tracestate list")
        elif key.startswith("openengine-"):
            invalid_argument(
                f"unknown OpenEngine metadata key {quote(key)} (the openengine- prefix is reserved)"
            )
        elif key.startswith("grpc-") or key.endswith("-bin") or key in _RESERVED:
            invalid_argument(f"metadata key {quote(key)} is reserved and cannot be forwarded")
        elif not allow_application_keys:
            invalid_argument(f"metadata key {quote(key)} is not an OpenEngine key")
        else:
            apps.append(key)
        if key in (ROUTING_KEY, TRACEPARENT, TRACESTATE):
            parsed[key] = value
        out.append((key, value))
    if TRACESTATE in seen and TRACEPARENT not in seen:
        invalid_argument("tracestate given without traceparent")
    return NormalizedMetadata(
        pairs=tuple(out),
        routing_key=parsed.get(ROUTING_KEY),  # type: ignore[arg-type]
        target_dp_rank=parsed.get(TARGET_DP_RANK),  # type: ignore[arg-type]
        priority=parsed.get(PRIORITY),  # type: ignore[arg-type]
        traceparent=parsed.get(TRACEPARENT),  # type: ignore[arg-type]
        tracestate=parsed.get(TRACESTATE),  # type: ignore[arg-type]
        application_keys=tuple(apps),
    )
