"""OpenEngine schema-revision negotiation (the schema's api.md, "Server identity"; docs/COMPATIBILITY.md).

Rules, checked in this order; the first failure raises :class:`NegotiationError`
with a one-line reason and nothing is served (fail closed):

1. ``schema_revision`` 0 is invalid (the engine does not implement the contract).
2. ``minimum_client_revision`` must be populated (0 is not a revision) and not
   above the server's own ``schema_revision`` (inconsistent).
3. ``schema_release`` is immutable (:func:`sidecar.openengine.releases.parse_release`):
   a 40-hex source commit, a 32-hex Buf Schema Registry commit (alone or as
   ``buf.build/<owner>/<module>:<commit>``) or a release tag (``v1.2.3``,
   ``openengine-v1.2.3``, optional ``-rc.1``/``-alpha.2``/``-beta.3``). Commits are
   reported in lower case. Branch names (``main``), module labels, ``unreleased``, short
   SHAs and empty strings are refused.
4. The revision numbering is decided (:func:`numbering_of`): the revisions were numbered
   1 → 3, then restarted at 1, so a number alone does not say which schema an engine speaks.
5. ``minimum_client_revision <= client revision`` of that numbering (3 for the original
   numbering, 1 for the restarted one: the engine still supports us).
6. ``schema_revision >= OLDEST_SERVER_REVISION`` (we still understand it). A newer
   server revision is accepted: revisions are additive, we speak
   ``min(server, client)`` (the release is then untested: see ``sidecar.core.compat``).
7. ``expected_engine`` (if given) equals ``engine_name`` case-insensitively, with
   ``-`` and ``_`` equivalent (``tensorrt-llm`` matches ``tensorrt_llm``).
8. ``expected_release`` (if given) names the advertised release: same form and id
   (commits case-insensitively, tags exactly; a module path is compared when both
   name one). An invalid ``expected_release`` is a caller bug (``ValueError``);
   validate CLI input with :func:`parse_release`.
"""

from __future__ import annotations

import msgspec

from sidecar.core.errors import NegotiationError
from sidecar.openengine import pb
from sidecar.openengine.releases import (
    CLIENT_REVISIONS,
    OLDEST_SERVER_REVISION,
    RELEASE_TAG_PATTERN,
    SOURCE_COMMIT_PATTERN,
    Numbering,
    Release,
    ReleaseKind,
    find_known,
)
from sidecar.openengine.releases import parse_release as _parse

__all__ = [
    "COMMIT_PATTERN",
    "RELEASE_FORMS",
    "RELEASE_TAG_PATTERN",
    "NegotiatedRevision",
    "NegotiationError",
    "engine_names_match",
    "negotiate",
    "numbering_of",
    "parse_release",
    "release_kind",
]

#: A source commit: exactly 40 hex digits (kept under its old name).
COMMIT_PATTERN = SOURCE_COMMIT_PATTERN
#: The accepted forms, for messages.
RELEASE_FORMS = (
    "a 40-hex source commit, a 32-hex BSR commit, buf.build/<owner>/<module>:<commit> "
    "or a release tag like v1.2.3"
)


class NegotiatedRevision(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """Outcome of a successful negotiation (also the card's ``schema`` section)."""

    #: Revision the server implements.
    server_revision: int
    #: Oldest client revision the server supports.
    minimum_client_revision: int
    #: Revision this build implements in the server's numbering.
    client_revision: int
    #: Revision both sides speak: ``min(server_revision, client_revision)``.
    revision: int
    #: Immutable release the server advertises (commits lower-cased).
    release: str
    #: ``commit`` (source commit), ``bsr`` (Buf Schema Registry commit) or ``tag``.
    release_kind: ReleaseKind
    #: The server is newer than this build (accepted: additive revisions).
    server_newer: bool
    #: Which revision numbering the server's numbers belong to: ``original`` (1 → 3) or
    #: ``restarted`` (1, the ``SchemaRevision`` enum); see :func:`numbering_of`.
    numbering: Numbering = "original"


def release_kind(release: str) -> ReleaseKind | None:
    """``commit`` / ``bsr`` / ``tag`` for an immutable release, ``None`` for anything else."""
    parsed = _parse(release)
    return None if parsed is None else parsed.kind


def parse_release(value: str) -> str:
    """Validate and normalize a release given by an operator; ``ValueError`` if mutable/malformed."""
    parsed = _parse(value.strip())
    if parsed is None:
        raise ValueError(f"{value.strip()!r} is not an immutable schema release ({RELEASE_FORMS})")
    return str(parsed)


def numbering_of(release: Release, info: pb.ServerInfo) -> Numbering:
    """Which revision numbering ``info`` speaks, decided in this order:

    a known release says it; a BSR commit is the restarted numbering (the registry
    distribution began with it); revisions 2 and above exist only in the original
    numbering; at revision 1 a KV connector that advertises ``handoff_profile`` or
    ``supports_client_bootstrap`` (fields the original revision 1 lacks) means restarted,
    else original. (At revision 1 both numberings accept the same clients, so the last
    rule only names the schema; the worker card refines it with ``ModelInfo``.)
    """
    known = find_known(release)
    if known is not None:
        return known.numbering
    if release.kind == "bsr":
        return "restarted"
    if info.schema_revision >= 2:
        return "original"
    kv = info.kv_connector
    if kv is not None and (kv.handoff_profile or kv.supports_client_bootstrap is not None):
        return "restarted"
    return "original"


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
    client_revision: int | None = None,
    oldest_server_revision: int = OLDEST_SERVER_REVISION,
) -> NegotiatedRevision:
    """Check ``info`` against this build's revision range; raise :class:`NegotiationError`.

    ``client_revision`` overrides this build's revision (in whatever numbering the
    server speaks); tests use it.
    """
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
    release = _parse(info.schema_release)
    if release is None:
        shown = repr(info.schema_release) if info.schema_release else "an empty schema_release"
        raise NegotiationError(
            f"{engine} advertises {shown}, not an immutable schema release ({RELEASE_FORMS})"
        )
    numbering = numbering_of(release, info)
    client = CLIENT_REVISIONS[numbering] if client_revision is None else client_revision
    if minimum > client:
        raise NegotiationError(
            f"{engine} advertises minimum_client_revision {minimum}: it requires a newer client; "
            f"this sidecar speaks OpenEngine revision {client} ({numbering} numbering, release "
            f"{release}; upgrade the sidecar)"
        )
    if server < oldest_server_revision:
        raise NegotiationError(
            f"{engine} speaks OpenEngine revision {server}; this sidecar supports revisions "
            f">= {oldest_server_revision} (upgrade the engine)"
        )
    if expected_engine is not None and not engine_names_match(expected_engine, info.engine_name):
        raise NegotiationError(
            f"expected engine {expected_engine!r} but the engine at this address is {info.engine_name!r}"
        )
    if expected_release is not None:
        want = _parse(expected_release.strip())
        if want is None:
            raise ValueError(f"{expected_release!r} is not an immutable schema release ({RELEASE_FORMS})")
        if not want.same_as(release):
            raise NegotiationError(f"expected schema release {want} but {engine} advertises {release}")
    return NegotiatedRevision(
        server_revision=server,
        minimum_client_revision=minimum,
        client_revision=client,
        revision=min(server, client),
        release=str(release),
        release_kind=release.kind,
        server_newer=server > client,
        numbering=numbering,
    )
