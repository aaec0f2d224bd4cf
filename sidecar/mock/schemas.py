"""The OpenEngine schema a simulated engine is built on (``mock-engine --schema``, ``--release-form``).

Engines built today follow one of three schemas (docs/COMPATIBILITY.md):

===========  ==========================================================================
``a66ff6f``  revision 3 (original numbering): everything, ``Drain`` included (default)
``4def7c5``  revision 1 (original numbering): no ``Drain``, ``handoff_profile``, client
             bootstrap, ``TokenizerInfo``, multimodal capabilities or ``media_options``
``31be5db``  revision 1 (restarted numbering): ``a66ff6f`` without ``Drain``
===========  ==========================================================================

An engine built on a schema sends only the fields that schema defines and cannot see the
ones it lacks (a protobuf parser keeps them as unknown fields the engine never reads). The
engine advertises the schema's revisions and its release in one of three forms: ``source``
(the 40-hex source commit), ``bsr`` (a Buf Schema Registry commit, 32 hex) or ``bsr-ref``
(``buf.build/openengine/openengine:<commit>``). No BSR commit of these schemas is published,
so the BSR forms use a synthetic commit derived from the source commit: an engine
advertising one is, as far as the sidecar knows, an untested release.

Integration: :func:`advertise` on ``ServerInfo`` / ``ModelInfo`` / a ``PrefillReady`` session
before they are sent; :func:`as_seen` on a request (and :func:`session_as_seen` on an
Abort's session) before the engine reads it; :func:`has` for behaviour (``Drain``, client
bootstrap, the profile a session must name).
"""

from __future__ import annotations

import hashlib
from typing import Literal, Protocol, TypeVar

from sidecar.openengine import pb
from sidecar.openengine.releases import KNOWN_RELEASES, KnownRelease

__all__ = [
    "BSR_MODULE",
    "RELEASE_FORMS",
    "SCHEMAS",
    "ReleaseForm",
    "advertise",
    "advertised_release",
    "as_seen",
    "has",
    "schema_of",
    "session_as_seen",
    "synthetic_bsr_commit",
]

ReleaseForm = Literal["source", "bsr", "bsr-ref"]
RELEASE_FORMS: tuple[str, ...] = ("source", "bsr", "bsr-ref")
#: The schema's Buf Schema Registry module (buf.yaml of each of the three commits).
BSR_MODULE = "buf.build/openengine/openengine"
#: The schemas a simulated engine can be built on, by short name.
SCHEMAS: dict[str, KnownRelease] = {k.name: k for k in KNOWN_RELEASES}

_M = TypeVar("_M", pb.ServerInfo, pb.ModelInfo, pb.KvSessionRef, pb.GenerateRequest)


class _HasSchema(Protocol):
    @property
    def schema(self) -> str: ...

    @property
    def release_form(self) -> str: ...


def schema_of(config: _HasSchema) -> KnownRelease:
    return SCHEMAS[config.schema]


def has(config: _HasSchema, feature: str) -> bool:
    """Whether the engine's schema defines ``feature`` (a name of ``releases.FEATURES``)."""
    return feature in schema_of(config).features


def synthetic_bsr_commit(source_commit: str) -> str:
    """A stable 32-hex stand-in for the BSR commit of ``source_commit`` (none is published)."""
    return hashlib.blake2b(f"mock bsr commit of {source_commit}".encode(), digest_size=16).hexdigest()


def advertised_release(config: _HasSchema) -> str:
    """``ServerInfo.schema_release`` in the configured form."""
    commit = schema_of(config).source_commits[0]
    if config.release_form == "source":
        return commit
    bsr = synthetic_bsr_commit(commit)
    return bsr if config.release_form == "bsr" else f"{BSR_MODULE}:{bsr}"


def _session(config: _HasSchema, ref: pb.KvSessionRef | None) -> None:
    if ref is None:
        return
    if not has(config, "handoffProfile"):
        ref.handoff_profile = ""
    if not has(config, "clientBootstrap"):
        ref.bootstrap = None


def advertise(config: _HasSchema, message: _M) -> _M:
    """``message`` (changed in place and returned) without the fields the schema lacks."""
    if isinstance(message, pb.ServerInfo):
        kv = message.kv_connector
        if kv is not None and not has(config, "handoffProfile"):
            kv.handoff_profile = ""
        if kv is not None and not has(config, "clientBootstrap"):
            kv.supports_client_bootstrap = None
    elif isinstance(message, pb.ModelInfo):
        if not has(config, "tokenizerInfo"):
            message.tokenizer = None
        if not has(config, "multimodalCapabilities"):
            message.multimodal_capabilities = None
    elif isinstance(message, pb.KvSessionRef):
        _session(config, message)
    return message


def as_seen(config: _HasSchema, request: pb.GenerateRequest) -> pb.GenerateRequest:
    """``request`` as an engine of the schema reads it: a copy without the fields it lacks."""
    if schema_of(config).features >= {"mediaOptions", "handoffProfile", "clientBootstrap"}:
        return request
    seen = pb.GenerateRequest.parse(bytes(request))
    if not has(config, "mediaOptions"):
        seen.media_options = None
    if seen.kv is not None:
        _session(config, seen.kv.session)
    return seen


def session_as_seen(config: _HasSchema, ref: pb.KvSessionRef) -> pb.KvSessionRef:
    """An Abort's ``kv_session`` as an engine of the schema reads it (a copy)."""
    seen = pb.KvSessionRef.parse(bytes(ref))
    _session(config, seen)
    return seen
