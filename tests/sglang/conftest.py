"""Session fixtures for the real-SGLang tests (marker ``sglang``; ``-m "not sglang"`` deselects them).

One engine start per run, shared by every test: ``sglang_engine``. Tests marked
``sglang_destructive`` (they leave the engine refusing work: Drain) run after all others.
Without the ``sglang`` extra the tests skip locally and fail under ``CI=true``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.real_engines import EngineProc
from tests.sglang.harness import require_sglang, start_engine
from tests.vllm.harness import build_model


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test under tests/sglang is marked ``sglang`` (and ``subprocess``: they run real
    processes); ``sglang_destructive`` ones run last."""
    here = Path(__file__).parent
    mine = [item for item in items if here in Path(str(item.fspath)).parents]
    for item in mine:
        item.add_marker(pytest.mark.sglang)
        item.add_marker(pytest.mark.subprocess)
    destructive = [item for item in mine if item.get_closest_marker("sglang_destructive") is not None]
    for item in destructive:
        items.remove(item)
        items.append(item)


@pytest.fixture(scope="session")
def sglang_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random-weight Llama (sidecar.engines.vllm.tiny_model), built once per session."""
    require_sglang()
    return build_model(tmp_path_factory.mktemp("sglang-model"))


@pytest.fixture(scope="session")
def sglang_engine(sglang_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProc]:
    """An ``sglang-engine`` on the tiny model, shared by the session."""
    tmp = tmp_path_factory.mktemp("sglang-a")
    proc = start_engine(sglang_model, tmp, "sglang-a")
    print(f"sglang-engine sglang-a started in {proc.started_in:.1f} s")
    try:
        yield proc
    finally:
        status = proc.stop()
        print(f"sglang-engine sglang-a stopped (exit {status})")
