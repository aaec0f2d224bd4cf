"""Compatibility by what the engine advertises: is its schema release one this build was
tested with, and which schema features do its answers carry (docs/COMPATIBILITY.md).

:func:`assess` is pure: from ``ServerInfo``, the ``ModelInfo`` answers and the negotiated
revision it returns the card's ``compatibility`` entry and, for a release this build was
not tested with, the one WARNING line that names it. An untested release is still served:
behaviour follows the fields the engine fills (presence), never the revision number. With
``run --require-known-release`` discovery refuses it instead (:func:`require_known`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import msgspec

from sidecar.core.errors import NegotiationError
from sidecar.core.negotiation import NegotiatedRevision
from sidecar.openengine import pb
from sidecar.openengine.releases import FEATURES, KNOWN_RELEASES, KnownRelease, find_known, parse_release

__all__ = ["CompatibilityCard", "KnownReleaseCard", "assess", "known_release_cards", "require_known"]


class KnownReleaseCard(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """One entry of this build's table of tested releases (``sidecar.knownReleases``)."""

    name: str
    source_commits: list[str]
    bsr_commits: list[str]
    numbering: str
    revision: int
    minimum_client_revision: int
    features: list[str]
    date: str
    summary: str


def known_release_cards() -> list[KnownReleaseCard]:
    """The table of known releases as card entries."""
    return [
        KnownReleaseCard(
            name=k.name,
            source_commits=list(k.source_commits),
            bsr_commits=list(k.bsr_commits),
            numbering=k.numbering,
            revision=k.revision,
            minimum_client_revision=k.minimum_client_revision,
            features=[f for f in FEATURES if f in k.features],
            date=k.date,
            summary=k.summary,
        )
        for k in KNOWN_RELEASES
    ]


class CompatibilityCard(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """The worker card's ``compatibility`` entry."""

    #: ``known``: a release this build was tested with; ``untested``: served on what the
    #: engine advertises (feature detection), with one WARNING at startup.
    status: Literal["known", "untested"]
    #: Short name of the known release (``a66ff6f``); ``None`` when untested.
    known_release: str | None
    #: The known schema the engine's answers match: same revision, every detected feature
    #: defined, fewest others (:func:`_resembles`); ``None`` when none does.
    resembles: str | None
    #: Per feature of :data:`~sidecar.openengine.releases.FEATURES`: ``true`` the schema has it
    #: (known release) or the engine's answers carry it (detected); ``false`` the known
    #: schema lacks it; ``null`` not detected (an untested engine did not fill the field, or
    #: ``drain``, which only a Drain call would show).
    features: dict[str, bool | None]
    #: Why untested, or what the known release is; one line.
    note: str


def _detected(info: pb.ServerInfo, models: Mapping[str, pb.ModelInfo]) -> dict[str, bool | None]:
    kv = info.kv_connector
    mis = list(models.values())
    mm = any(mi.multimodal_capabilities is not None for mi in mis)
    return {
        "drain": None,
        "handoffProfile": True if kv is not None and kv.handoff_profile else None,
        "clientBootstrap": True if kv is not None and kv.supports_client_bootstrap is not None else None,
        "tokenizerInfo": True if any(mi.tokenizer is not None for mi in mis) else None,
        "multimodalCapabilities": True if mm else None,
        "mediaOptions": True if mm else None,
    }


def _resembles(numbering: str, revision: int, detected: Mapping[str, bool | None]) -> KnownRelease | None:
    """The known release at ``revision`` defining every detected feature with the fewest
    features undetected (an engine may leave a field empty; it cannot send one its schema
    lacks), the same numbering first on a tie."""
    found = {f for f, v in detected.items() if v}
    candidates = [k for k in KNOWN_RELEASES if k.revision == revision and found <= k.features]
    candidates.sort(key=lambda k: (len(k.features - found), k.numbering != numbering))
    return candidates[0] if candidates else None


def assess(
    info: pb.ServerInfo, negotiated: NegotiatedRevision, models: Mapping[str, pb.ModelInfo]
) -> tuple[NegotiatedRevision, CompatibilityCard, str | None]:
    """(negotiated, compatibility entry, WARNING line or ``None``) for an engine's discovery.

    ``negotiated`` comes back refined: an untested revision-1 source release whose models
    carry tokenizer info or multimodal capabilities (fields the original revision 1 lacks)
    speaks the restarted numbering (at revision 1 both numberings accept the same clients).
    """
    release = parse_release(negotiated.release)
    assert release is not None, "negotiate() accepted an immutable release"
    known = find_known(release)
    detected = _detected(info, models)
    if (
        known is None
        and release.kind != "bsr"
        and negotiated.server_revision == 1
        and negotiated.numbering == "original"
        and (detected["tokenizerInfo"] or detected["multimodalCapabilities"])
    ):
        negotiated = msgspec.structs.replace(negotiated, numbering="restarted")
    mismatch = known is not None and (
        (negotiated.numbering, negotiated.server_revision, negotiated.minimum_client_revision)
        != (known.numbering, known.revision, known.minimum_client_revision)
    )
    if known is not None and not mismatch:
        card = CompatibilityCard(
            status="known",
            known_release=known.name,
            resembles=known.name,
            features={f: f in known.features for f in FEATURES},
            note=f"{known.name} ({release.form}, {known.date}): {known.summary}",
        )
        return negotiated, card, None
    like = _resembles(negotiated.numbering, negotiated.server_revision, detected)
    if known is not None:
        why = (
            f"names known release {known.name} but advertises revision {negotiated.server_revision} "
            f"(minimum client {negotiated.minimum_client_revision}); {known.name} is revision "
            f"{known.revision} (minimum client {known.minimum_client_revision})"
        )
    elif negotiated.server_newer:
        why = f"is newer than this build (revision {negotiated.server_revision} of the {negotiated.numbering} numbering)"
    else:
        why = "is not one this build was tested with"
    found = [f for f, v in detected.items() if v]
    missing = [f for f, v in detected.items() if not v and f != "drain"]
    note = (
        f"{release.form} {release} {why}; served by feature detection "
        f"(revision {negotiated.server_revision}, {negotiated.numbering} numbering"
        f"{', like ' + like.name if like else ', like no known release'}; "
        f"detected: {', '.join(found) or 'none'}; not detected: {', '.join(missing) or 'none'}; "
        "drain: tried, local if UNIMPLEMENTED)"
    )
    card = CompatibilityCard(
        status="untested",
        known_release=None,
        resembles=like.name if like else None,
        features=detected,
        note=note,
    )
    known_names = ", ".join(k.name for k in KNOWN_RELEASES)
    warning = f"engine {info.engine_name or '?'} schema release untested (known: {known_names}): {note}"
    return negotiated, card, warning


def require_known(engine: str, compatibility: CompatibilityCard) -> None:
    """``--require-known-release``: refuse an untested release (:class:`NegotiationError`)."""
    if compatibility.status != "known":
        raise NegotiationError(
            f"{engine or 'engine'}: {compatibility.note}; --require-known-release refuses releases "
            "this build was not tested with"
        )
