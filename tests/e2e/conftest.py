"""Every test under tests/e2e is marked ``subprocess``: each runs the sidecar and engines (or,
in test_childproc.py, the child processes ``sidecar.childproc`` manages) as real processes."""

from __future__ import annotations

from pathlib import Path

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.subprocess)
