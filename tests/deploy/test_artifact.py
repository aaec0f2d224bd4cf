"""One exact artifact: --version and the worker card name the build; the lock files cover
pyproject.toml; scripts/build-artifact builds the same bytes twice."""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from sidecar import __version__, version
from sidecar.core.card import SidecarCard
from sidecar.openengine.releases import KNOWN_RELEASES, SCHEMA_RELEASE
from tests.deploy.helpers import ROOT

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_version_prints_version_commit_and_schema_release() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "sidecar", "--version"], capture_output=True, text=True, check=True, timeout=60
    ).stdout.splitlines()
    assert out[:4] == [
        f"openengine-sidecar {__version__}",
        f"commit {version.source_commit()}",
        f"openengine schema release {SCHEMA_RELEASE} (ai-dynamo/openengine, revision 3)",
        "known schema releases (others are served by feature detection, with a warning):",
    ]
    # the table of tested releases, one line each: name, source commit, revision lineage
    assert [line.split()[:2] for line in out[4:]] == [[k.name, k.source_commits[0]] for k in KNOWN_RELEASES]
    assert "revision 1 (restarted numbering)" in out[-1] and "drain" not in out[-1]


def test_checkout_commit_is_head() -> None:
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode != 0:
        pytest.skip("not a git checkout")
    assert version.source_commit().removesuffix("-dirty") == head.stdout.strip()


def test_worker_card_carries_the_build() -> None:
    card = SidecarCard()
    assert (card.version, card.commit, card.schema_release) == (
        __version__,
        version.source_commit(),
        SCHEMA_RELEASE,
    )


def test_build_info_wins_over_the_checkout(monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    module = types.ModuleType("sidecar._build_info")
    module.COMMIT = "0123abc"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "sidecar._build_info", module)
    version.source_commit.cache_clear()
    try:
        assert version.source_commit() == "0123abc"
        assert "commit 0123abc" in version.version_text()
    finally:
        version.source_commit.cache_clear()


def test_no_checkout_means_unknown(tmp_path: Path) -> None:
    assert version._checkout_commit(tmp_path) is None


def pins(lock: Path) -> dict[str, tuple[str, str]]:
    """name -> (version, marker) of a lock file; every pin must carry hashes."""
    text = lock.read_text()
    out: dict[str, tuple[str, str]] = {}
    for block in re.split(r"\n(?=[A-Za-z0-9])", text):
        m = re.match(r"([A-Za-z0-9_.\-]+)==([^\s;\\]+)\s*(?:;\s*([^\\\n]+))?", block)
        if m:
            assert "--hash=sha256:" in block, f"{lock.name}: {m.group(1)} has no hash"
            out[canonicalize_name(m.group(1))] = (m.group(2), (m.group(3) or "").strip())
    return out


def check_covered(requirements: list[str], lock: Path) -> None:
    locked = pins(lock)
    env = dict(default_environment())
    for text in requirements:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate(env):  # type: ignore[arg-type]
            continue
        name = canonicalize_name(req.name)
        assert name in locked, f"{req.name} is not in {lock.name}: run scripts/lock"
        assert req.specifier.contains(locked[name][0], prereleases=True), (
            f"{lock.name} pins {req.name}=={locked[name][0]}, pyproject.toml wants {req.specifier}: run scripts/lock"
        )


def test_runtime_lock_covers_dependencies() -> None:
    check_covered(PYPROJECT["project"]["dependencies"], ROOT / "requirements.lock")


def test_dev_lock_covers_dependencies_and_dev_extra() -> None:
    reqs = PYPROJECT["project"]["dependencies"] + PYPROJECT["project"]["optional-dependencies"]["dev"]
    check_covered(reqs, ROOT / "requirements-dev.lock")
    runtime = pins(ROOT / "requirements.lock")
    dev = pins(ROOT / "requirements-dev.lock")
    assert all(dev.get(name, (None,))[0] == pin[0] for name, pin in runtime.items()), (
        "runtime and dev locks disagree"
    )


def test_build_lock_covers_the_build_backend() -> None:
    check_covered(PYPROJECT["build-system"]["requires"], ROOT / "requirements-build.lock")


def test_setup_installs_from_the_lock() -> None:
    setup = (ROOT / "scripts" / "setup").read_text()
    assert "--require-hashes -r requirements-dev.lock" in setup
    assert '-e ".[dev]"' in setup


def build(out: Path, env: dict[str, str]) -> tuple[str, Path]:
    result = subprocess.run(
        [str(ROOT / "scripts" / "build-artifact"), "-o", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    digest, _, path = result.stdout.strip().partition("  ")
    return digest, Path(path)


@pytest.mark.subprocess  # three wheel builds
def test_two_builds_give_the_same_wheel(tmp_path: Path) -> None:
    import os

    env = {**os.environ, "BUILD_COMMIT": "feedfacefeedfacefeedfacefeedfacefeedface"}
    first_hash, first = build(tmp_path / "one", env)
    second_hash, second = build(tmp_path / "two", env)
    assert first.name == second.name == f"openengine_sidecar-{__version__}-py3-none-any.whl"
    assert first_hash == second_hash == hashlib.sha256(first.read_bytes()).hexdigest()
    assert first.read_bytes() == second.read_bytes()
    with zipfile.ZipFile(first) as wheel:
        names = wheel.namelist()
        assert "sidecar/_build_info.py" in names and "sidecar/version.py" in names
        assert not [n for n in names if n.startswith("tests/") or "__pycache__" in n]
    # The installed artifact names its build.
    out = subprocess.run(
        [sys.executable, "-m", "sidecar", "--version"],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(first)},
        cwd=tmp_path,
        timeout=60,
    ).stdout
    assert "commit feedfacefeedfacefeedfacefeedfacefeedface" in out
    # A different commit is a different artifact.
    other_hash, _ = build(tmp_path / "three", {**env, "BUILD_COMMIT": "0" * 40})
    assert other_hash != first_hash
