"""What this build is: package version, source commit, OpenEngine schema release.

``openengine-sidecar --version`` prints it, with the schema releases this build was
tested with, and the worker card carries it (``sidecar.commit``, ``sidecar.knownReleases``),
so an operator can tell which exact artifact serves and which engines it knows. The commit
comes from the build: ``scripts/build-artifact`` writes ``sidecar/_build_info.py``
into the wheel. In a source checkout (editable install) it falls back to
``git rev-parse HEAD`` of that checkout, with ``-dirty`` when the package sources
have uncommitted changes; anywhere else it is ``"unknown"``.
"""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path

from sidecar import __version__
from sidecar.openengine.releases import (
    CLIENT_REVISION,
    FEATURES,
    KNOWN_RELEASES,
    SCHEMA_RELEASE,
    SCHEMA_REPOSITORY,
)

__all__ = ["SCHEMA_RELEASE", "UNKNOWN_COMMIT", "VERSION", "build_info", "source_commit", "version_text"]

VERSION = __version__
UNKNOWN_COMMIT = "unknown"
_PACKAGE_DIR = Path(__file__).resolve().parent


@functools.cache
def source_commit() -> str:
    """The source commit this build came from (cached; never raises)."""
    try:
        from sidecar import _build_info  # type: ignore[attr-defined]  # written by scripts/build-artifact
    except ImportError:
        pass
    else:
        commit = getattr(_build_info, "COMMIT", "")
        if isinstance(commit, str) and commit:
            return commit
    return _checkout_commit(_PACKAGE_DIR.parent) or UNKNOWN_COMMIT


def _checkout_commit(root: Path) -> str | None:
    """``HEAD`` of the git checkout the package sources live in (``-dirty`` if they changed)."""
    if not (root / ".git").exists():  # an installed copy inside some other repository: not ours
        return None
    try:
        head = _git(root, "rev-parse", "--verify", "HEAD")
        status = _git(root, "status", "--porcelain", "--", "sidecar", "pyproject.toml")
    except (OSError, subprocess.SubprocessError):
        return None
    if not head:
        return None
    return head + ("-dirty" if status else "")


def _git(root: Path, *args: str) -> str:
    out = subprocess.run(
        ["git", "-C", str(root), *args],
        check=True,
        capture_output=True,
        text=True,
        timeout=10,
        stdin=subprocess.DEVNULL,
    )
    return out.stdout.strip()


def build_info() -> dict[str, str | int]:
    """Version, commit and schema identity as one mapping (for logs and tools)."""
    return {
        "version": VERSION,
        "commit": source_commit(),
        "schemaRelease": SCHEMA_RELEASE,
        "schemaRepository": SCHEMA_REPOSITORY,
        "clientRevision": CLIENT_REVISION,
    }


def known_releases_text() -> list[str]:
    """One line per known schema release: name, source commit(s), revision, features."""
    lines = []
    for k in KNOWN_RELEASES:
        features = ", ".join(f for f in FEATURES if f in k.features) or "none"
        first, *same = k.source_commits
        commits = first + (f" (same schema: {', '.join(same)})" if same else "")
        bsr = f", BSR {' '.join(k.bsr_commits)}" if k.bsr_commits else ""
        lines.append(
            f"  {k.name}  {commits}{bsr}  revision {k.revision} ({k.numbering} numbering), "
            f"minimum client {k.minimum_client_revision}; features: {features}"
        )
    return lines


def version_text(prog: str = "openengine-sidecar") -> str:
    """The ``--version`` text: version, commit and schema release (one line each), then the
    known schema releases (others are served by feature detection, with a warning)."""
    return "\n".join(
        [
            f"{prog} {VERSION}",
            f"commit {source_commit()}",
            f"openengine schema release {SCHEMA_RELEASE} ({SCHEMA_REPOSITORY}, revision {CLIENT_REVISION})",
            "known schema releases (others are served by feature detection, with a warning):",
            *known_releases_text(),
        ]
    )
