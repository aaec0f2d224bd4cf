"""Prerequisites a test needs from the machine: skip with the reason locally, fail under CI.

CI (``.ci/run``) installs every tool and optional extra the suite uses, so a missing one there
is a broken CI setup, never a reason to pass quietly.
"""

from __future__ import annotations

import importlib
import os
import shutil
from types import ModuleType

import pytest


def _missing(message: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message, allow_module_level=True)


def require(condition: bool, message: str) -> None:
    """Skip with ``message`` unless ``condition`` (fail under CI)."""
    if not condition:
        _missing(message)


def require_tool(name: str, installer: str = "scripts/ci-deps") -> str:
    """Path of a command-line tool; skip when absent locally, fail in CI (``installer`` installs it)."""
    path = shutil.which(name)
    if path is None:
        _missing(f"{name} is not installed ({installer} installs it)")
        raise AssertionError("unreachable")
    return path


def require_module(name: str, installer: str) -> ModuleType:
    """Import an optional module; skip when absent locally, fail in CI (``installer`` installs it)."""
    try:
        return importlib.import_module(name)
    except ImportError as err:
        _missing(f"{name} is not importable ({err}); run {installer}")
        raise AssertionError("unreachable") from err
