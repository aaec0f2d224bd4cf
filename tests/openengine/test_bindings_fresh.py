"""scripts/gen-bindings --check: passes on the committed bindings, fails once one is edited."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def copy_tree(dest: Path) -> Path:
    for part in ("scripts/gen-bindings", "schema", "sidecar/openengine/_generated"):
        src, dst = ROOT / part, dest / part
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, dst)
        else:
            shutil.copy2(src, dst)
    return dest


def check(root: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHON": sys.executable}
    return subprocess.run(
        ["bash", str(root / "scripts/gen-bindings"), "--check"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_committed_bindings_are_fresh(tmp_path: Path) -> None:
    result = check(copy_tree(tmp_path))
    assert result.returncode == 0, result.stderr


def test_an_edited_binding_fails_the_check(tmp_path: Path) -> None:
    root = copy_tree(tmp_path)
    target = root / "sidecar/openengine/_generated/openengine/v1/__init__.py"
    target.write_text(
        target.read_text().replace("class GenerateRequest", "class GenerateRequest  # edited", 1)
    )
    result = check(root)
    assert result.returncode == 1
    assert "stale or edited" in result.stderr


def test_a_schema_change_without_regeneration_fails_the_check(tmp_path: Path) -> None:
    root = copy_tree(tmp_path)
    proto = root / "schema/openengine/v1/lora.proto"
    proto.write_text(proto.read_text() + "\nmessage AddedWithoutRegenerating {}\n")
    assert check(root).returncode == 1
