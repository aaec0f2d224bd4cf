"""Session fixtures for the real-vLLM tests (marker ``vllm``; ``-m "not vllm"`` deselects them).

Two engine starts per run at most, shared by every test: ``vllm_engine`` (most tests) and
``vllm_engine_b`` (the second engine of the KV-aware routing test). Tests marked
``vllm_destructive`` (they leave an engine refusing work: Drain) run after all others.
Without the ``vllm`` extra the tests skip locally and fail under ``CI=true``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.vllm.harness import VllmProc, build_model, require_vllm, start_engine


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test under tests/vllm is marked ``vllm`` and ``subprocess``; ``vllm_destructive``
    ones run last."""
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.vllm)
            item.add_marker(pytest.mark.subprocess)
    items.sort(key=lambda item: item.get_closest_marker("vllm_destructive") is not None)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random-weight Llama (sidecar.engines.vllm.tiny_model), built once per session."""
    require_vllm()
    return build_model(tmp_path_factory.mktemp("vllm-model"))


def _engine(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory, name: str) -> Iterator[VllmProc]:
    tmp = tmp_path_factory.mktemp(name)
    proc = start_engine(tiny_model, tmp, name)
    print(f"vllm-engine {name} started in {proc.started_in:.1f} s")
    try:
        yield proc
    finally:
        status = proc.stop()
        print(f"vllm-engine {name} stopped (exit {status})")


@pytest.fixture(scope="session")
def vllm_engine(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmProc]:
    """A ``vllm-engine`` on the tiny model, shared by the session."""
    yield from _engine(tiny_model, tmp_path_factory, "vllm-a")


@pytest.fixture(scope="session")
def vllm_engine_b(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmProc]:
    """A second engine (KV-aware routing needs two)."""
    yield from _engine(tiny_model, tmp_path_factory, "vllm-b")
