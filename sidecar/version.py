"""What this build is: package version, source commit, OpenEngine schema release.

``openengine-sidecar --version`` prints it and the worker card carries it
(``sidecar.commit``), so an operator can tell which exact artifact serves. The commit
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
from sidecar.openengine.revision import CLIENT_REVISION, SCHEMA_RELEASE, SCHEMA_REPOSITORY

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


def version_text(prog: str = "openengine-sidecar") -> str:
    """The ``--version`` text: three lines, one fact each."""
    return (
        f"{prog} {VERSION}\n"
        f"commit {source_commit()}\n"
        f"openengine schema release {SCHEMA_RELEASE} ({SCHEMA_REPOSITORY}, revision {CLIENT_REVISION})"
    )
