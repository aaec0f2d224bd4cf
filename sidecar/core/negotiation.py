"""OpenEngine schema-revision negotiation (the schema's api.md, "Server identity").

Rules, checked in this order; the first failure raises :class:`NegotiationError`
with a one-line reason and nothing is served (fail closed):

1. ``schema_revision`` 0 is invalid (the engine does not implement the contract).
2. ``minimum_client_revision`` must be populated (0 is not a revision) and not
   above the server's own ``schema_revision`` (inconsistent).
3. ``minimum_client_revision <= CLIENT_REVISION`` (the engine still supports us).
4. ``schema_revision >= OLDEST_SERVER_REVISION`` (we still understand it). A newer
   server revision is accepted: revisions are additive, we speak
   ``min(server, CLIENT_REVISION)``.
5. ``schema_release`` is immutable: a 40-hex commit SHA (either case, reported in
   lower case) or a release tag matching :data:`RELEASE_TAG_PATTERN`
   (``v1.2.3``, ``openengine-v1.2.3``, optional ``-rc.1``/``-alpha.2``/``-beta.3``).
   Branch names (``main``), ``unreleased``, short SHAs and empty strings are refused.
6. ``expected_engine`` (if given) equals ``engine_name`` case-insensitively, with
   ``-`` and ``_`` equivalent (``tensorrt-llm`` matches ``tensorrt_llm``).
7. ``expected_release`` (if given) equals the advertised release: commits compare
   case-insensitively, tags exactly. An invalid ``expected_release`` is a caller
   bug (``ValueError``); validate CLI input with :func:`parse_release`.
"""

from __future__ import annotations

import re
from typing import Literal

import msgspec

from sidecar.core.errors import NegotiationError
from sidecar.openengine import pb
from sidecar.openengine.revision import CLIENT_REVISION, OLDEST_SERVER_REVISION

__all__ = [
    "COMMIT_PATTERN",
    "RELEASE_TAG_PATTERN",
    "NegotiatedRevision",
    "NegotiationError",
    "engine_names_match",
    "negotiate",
    "parse_release",
    "release_kind",
]

#: An immutable commit: exactly 40 hex digits.
COMMIT_PATTERN = re.compile(r"[0-9a-fA-F]{40}")
#: A release tag: ``v<major>.<minor>.<patch>`` optionally prefixed ``openengine-`` and
#: suffixed with a pre-release ``-rc.N`` / ``-alpha.N`` / ``-beta.N`` (dot optional).
RELEASE_TAG_PATTERN = re.compile(r"(?:openengine-)?v\d+\.\d+\.\d+(?:-(?:rc|alpha|beta)\.?\d+)?")

ReleaseKind = Literal["commit", "tag"]


class NegotiatedRevision(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """Outcome of a successful negotiation (also the card's ``schema`` section)."""

    #: Revision the server implements.
    server_revision: int
    #: Oldest client revision the server supports.
    minimum_client_revision: int
    #: Revision this build was compiled at.
    client_revision: int
    #: Revision both sides speak: ``min(server_revision, client_revision)``.
    revision: int
    #: Immutable release the server advertises (commits lower-cased).
    release: str
    release_kind: ReleaseKind
    #: The server is newer than this build (accepted: additive revisions).
    server_newer: bool


def release_kind(release: str) -> ReleaseKind | None:
    """``"commit"`` / ``"tag"`` for an immutable release, ``None`` for anything else."""
    if COMMIT_PATTERN.fullmatch(release):
        return "commit"
    if RELEASE_TAG_PATTERN.fullmatch(release):
        return "tag"
    return None


def parse_release(value: str) -> str:
    """Validate and normalize a release given by an operator; ``ValueError`` if mutable/malformed."""
    value = value.strip()
    kind = release_kind(value)
    if kind is None:
        raise ValueError(
            f"{value!r} is not an immutable schema release (a 40-hex commit or a tag like v1.2.3)"
        )
    return value.lower() if kind == "commit" else value


def engine_names_match(expected: str, actual: str) -> bool:
    """Case-insensitive engine-name comparison with ``-`` and ``_`` equivalent."""

    def norm(s: str) -> str:
        return s.strip().casefold().replace("-", "_")

    return norm(expected) == norm(actual)


def negotiate(
    info: pb.ServerInfo,
    *,
    expected_engine: str | None = None,
    expected_release: str | None = None,
    client_revision: int = CLIENT_REVISION,
    oldest_server_revision: int = OLDEST_SERVER_REVISION,
) -> NegotiatedRevision:
    """Check ``info`` against this build's revision range; raise :class:`NegotiationError`."""
    engine = info.engine_name or "engine"
    server = int(info.schema_revision)
    minimum = int(info.minimum_client_revision)
    if server == 0:
        raise NegotiationError(
            f"{engine} advertises schema_revision 0 (invalid): it does not implement OpenEngine "
            "revision negotiation"
        )
    if minimum == 0:
        raise NegotiationError(
            f"{engine} advertises minimum_client_revision 0 (not populated): refusing an engine "
            "that does not state which clients it supports"
        )
    if minimum > server:
        raise NegotiationError(
            f"{engine} advertises minimum_client_revision {minimum} above its own schema_revision "
            f"{server} (inconsistent)"
        )
    if minimum > client_revision:
        raise NegotiationError(
            f"{engine} advertises minimum_client_revision {minimum}: it requires a newer client; "
            f"this sidecar speaks OpenEngine revision {client_revision} (upgrade the sidecar)"
        )
    if server < oldest_server_revision:
        raise NegotiationError(
            f"{engine} speaks OpenEngine revision {server}; this sidecar supports revisions "
            f">= {oldest_server_revision} (upgrade the engine)"
        )
    release = info.schema_release
    kind = release_kind(release)
    if kind is None:
        shown = repr(info.schema_release) if info.schema_release else "an empty schema_release"
        raise NegotiationError(
            f"{engine} advertises {shown}, not an immutable schema release (a 40-hex commit or a "
            "release tag like v1.2.3)"
        )
    if kind == "commit":
        release = release.lower()
    if expected_engine is not None and not engine_names_match(expected_engine, info.engine_name):
        raise NegotiationError(
            f"expected engine {expected_engine!r} but the engine at this address is {info.engine_name!r}"
        )
    if expected_release is not None:
        want = parse_release(expected_release)
        if want != release:
            raise NegotiationError(f"expected schema release {want} but {engine} advertises {release}")
    return NegotiatedRevision(
        server_revision=server,
        minimum_client_revision=minimum,
        client_revision=client_revision,
        revision=min(server, client_revision),
        release=release,
        release_kind=kind,
        server_newer=server > client_revision,
    )
