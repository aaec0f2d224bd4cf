"""The OpenEngine schema releases this build was tested with, and the forms a release takes.

Pure data and parsing (no I/O). ``docs/COMPATIBILITY.md`` explains every entry.

Release forms an engine may advertise in ``ServerInfo.schema_release`` (all immutable):

- a **source commit** of ai-dynamo/openengine: 40 hex digits (either case; kept lower-case);
- a **Buf Schema Registry commit** of the published module: 32 hex digits, alone or as a
  reference ``<registry host>/<owner>/<module>:<commit>`` (``buf.build/openengine/openengine:…``);
- a **release tag**: ``v1.2.3``, ``openengine-v1.2.3``, optional ``-rc.1`` / ``-alpha.2`` / ``-beta.3``.

Branch names (``main``), labels after a module (``…:main``), ``unreleased``, short SHAs and
empty strings are mutable or ambiguous and are refused.

Revision numberings: the schema's revisions were first numbered 1 → 3 (``original``;
``a66ff6f`` is revision 3), then restarted at 1 with the ``SchemaRevision`` enum when
the Buf Schema Registry became the distribution (``restarted``; ``31be5db``). So
"revision 1" names two different schemas; ``sidecar.core.negotiation.numbering_of`` decides which one an
engine speaks from its release and what it advertises.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "BSR_COMMIT_PATTERN",
    "BSR_REFERENCE_PATTERN",
    "CLIENT_REVISION",
    "CLIENT_REVISIONS",
    "FEATURES",
    "KNOWN_RELEASES",
    "OLDEST_SERVER_REVISION",
    "RELEASE_TAG_PATTERN",
    "SCHEMA_RELEASE",
    "SCHEMA_REPOSITORY",
    "SOURCE_COMMIT_PATTERN",
    "KnownRelease",
    "Numbering",
    "Release",
    "ReleaseKind",
    "find_known",
    "parse_release",
    "spec_url",
]

ReleaseKind = Literal["commit", "bsr", "tag"]
Numbering = Literal["original", "restarted"]

#: A source commit of the schema repository: exactly 40 hex digits.
SOURCE_COMMIT_PATTERN = re.compile(r"[0-9a-fA-F]{40}")
#: A Buf Schema Registry module commit: exactly 32 hex digits.
BSR_COMMIT_PATTERN = re.compile(r"[0-9a-fA-F]{32}")
#: ``<registry host>/<owner>/<module>:<32-hex commit>`` (a label after the colon is mutable: refused).
BSR_REFERENCE_PATTERN = re.compile(
    r"(?P<module>(?:[a-z0-9](?:[a-z0-9-]*[a-z0-9])?\.)+[a-z]{2,}/[a-z0-9][a-z0-9-]*/[a-z0-9][a-z0-9-]*)"
    r":(?P<commit>[0-9a-fA-F]{32})"
)
#: A release tag: ``v<major>.<minor>.<patch>`` optionally prefixed ``openengine-`` and
#: suffixed with a pre-release ``-rc.N`` / ``-alpha.N`` / ``-beta.N`` (dot optional).
RELEASE_TAG_PATTERN = re.compile(r"(?:openengine-)?v\d+\.\d+\.\d+(?:-(?:rc|alpha|beta)\.?\d+)?")

#: The revision this build's bindings implement, per numbering: revision 3 of the original
#: numbering (a66ff6f) and revision 1 of the restarted one (31be5db = a66ff6f without Drain).
CLIENT_REVISIONS: dict[Numbering, int] = {"original": 3, "restarted": 1}

#: Schema features the sidecar's behaviour depends on (names as in the worker card).
FEATURES = (
    "drain",  # Control.Drain
    "handoffProfile",  # KvConnectorInfo.handoff_profile / KvSessionRef.handoff_profile
    "clientBootstrap",  # KvConnectorInfo.supports_client_bootstrap / KvSessionRef.bootstrap
    "tokenizerInfo",  # ModelInfo.tokenizer
    "multimodalCapabilities",  # ModelInfo.multimodal_capabilities
    "mediaOptions",  # GenerateRequest.media_options
)


@dataclass(frozen=True)
class Release:
    """An immutable release as advertised: its form and its identifying value."""

    kind: ReleaseKind
    #: Lower-case commit (source or BSR) or the tag as written.
    id: str
    #: ``buf.build/<owner>/<module>`` when given as a module reference, else ``""``.
    module: str = ""

    def __str__(self) -> str:
        return f"{self.module}:{self.id}" if self.module else self.id

    def same_as(self, other: Release) -> bool:
        """Same form and id; modules are compared only when both name one."""
        if (self.kind, self.id) != (other.kind, other.id):
            return False
        return not (self.module and other.module) or self.module == other.module

    @property
    def form(self) -> str:
        """A few words for messages: ``source commit`` / ``BSR commit`` / ``release tag``."""
        return {"commit": "source commit", "bsr": "BSR commit", "tag": "release tag"}[self.kind]


def parse_release(value: str) -> Release | None:
    """The :class:`Release` ``value`` names, or ``None`` when it is not an immutable release."""
    if SOURCE_COMMIT_PATTERN.fullmatch(value):
        return Release("commit", value.lower())
    if BSR_COMMIT_PATTERN.fullmatch(value):
        return Release("bsr", value.lower())
    m = BSR_REFERENCE_PATTERN.fullmatch(value)
    if m is not None:
        return Release("bsr", m["commit"].lower(), m["module"])
    if RELEASE_TAG_PATTERN.fullmatch(value):
        return Release("tag", value)
    return None


@dataclass(frozen=True)
class KnownRelease:
    """One schema release this build was tested with (``docs/COMPATIBILITY.md``)."""

    #: Short name (the first seven hex digits of its source commit).
    name: str
    #: Source commits whose schema is exactly this one (the first is the release itself).
    source_commits: tuple[str, ...]
    numbering: Numbering
    revision: int
    minimum_client_revision: int
    #: The subset of :data:`FEATURES` the schema defines.
    features: frozenset[str]
    #: Date of the source commit (UTC) and one line on what it is.
    date: str
    summary: str
    #: Published Buf Schema Registry commits of this schema (none published yet).
    bsr_commits: tuple[str, ...] = ()
    tags: tuple[str, ...] = ()

    def matches(self, release: Release) -> bool:
        if release.kind == "commit":
            return release.id in self.source_commits
        if release.kind == "bsr":
            return release.id in self.bsr_commits
        return release.id in self.tags


_ALL = frozenset(FEATURES)

#: The releases this build was tested with, oldest schema first.
KNOWN_RELEASES: tuple[KnownRelease, ...] = (
    KnownRelease(
        name="4def7c5",
        source_commits=("4def7c50b05e0674a0c3b26917399155535966e4",),
        numbering="original",
        revision=1,
        minimum_client_revision=1,
        features=frozenset(),
        date="2026-07-23",
        summary="main before the revision-3 merge: no Drain, no handoff profile, client bootstrap, "
        "tokenizer info, multimodal capabilities or media options",
    ),
    KnownRelease(
        name="a66ff6f",
        source_commits=("a66ff6f73a65e262a7c3edd5ea6fd0d8701d402f",),
        numbering="original",
        revision=3,
        minimum_client_revision=1,
        features=_ALL,
        date="2026-07-23",
        summary="revision 3 (the schema/ of this build): everything, Drain included",
    ),
    KnownRelease(
        name="31be5db",
        source_commits=(
            "31be5dbeaaf5737a008abe9d29f0c07f3e80a4ef",
            "8ce850d40dc00097de3a592fd1c4ec5b69b2b952",  # its second parent: the same schema
        ),
        numbering="restarted",
        revision=1,
        minimum_client_revision=1,
        features=_ALL - {"drain"},
        date="2026-07-24",
        summary="revision numbering restarted at 1 (SchemaRevision), Drain removed, "
        "BSR module commit as schema_release",
    ),
)


def find_known(release: Release) -> KnownRelease | None:
    """The known release ``release`` names, if any."""
    return next((k for k in KNOWN_RELEASES if k.matches(release)), None)


# -- the revision this build speaks ------------------------------------------------------------

#: Revision of the OpenEngine v1 wire contract our bindings were generated at.
CLIENT_REVISION = 3
#: Oldest server revision whose wire shape we still understand.
OLDEST_SERVER_REVISION = 1
#: Immutable commit of ai-dynamo/openengine that schema/ reproduces.
SCHEMA_RELEASE = "a66ff6f73a65e262a7c3edd5ea6fd0d8701d402f"
#: Repository the release refers to.
SCHEMA_REPOSITORY = "ai-dynamo/openengine"


def spec_url(section: str = "") -> str:
    """Where the schema's field-level rules are written: its ``docs/api.md`` at
    :data:`SCHEMA_RELEASE`, optionally at one section's anchor."""
    url = f"https://github.com/{SCHEMA_REPOSITORY}/blob/{SCHEMA_RELEASE}/docs/api.md"
    return f"{url}#{section}" if section else url
