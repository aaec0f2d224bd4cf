"""The layer rules of docs/design/architecture.md, checked on the source.

A package may import only packages of a lower rank (shared utilities are rank 0), and the
third-party libraries whose world must stay behind one boundary (grpclib/h2, asyncio,
Dynamo's runtime, vLLM) are imported only where the design says.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "sidecar"

#: top-level module or package under sidecar/ -> rank; imports must point to a lower rank.
RANK: dict[str, int] = {
    "nursery": 0,
    "addresses": 0,
    "metrics_registry": 0,
    "logs": 0,
    "cli_common": 1,
    "cli_help": 1,
    "cli_options": 2,
    "childproc": 0,
    "sdnotify": 0,
    "quoting": 0,
    "json_types": 0,
    "socket_io": 0,
    "loopwatch": 1,
    "tracing": 1,
    "openengine": 1,
    "version": 2,
    "core": 3,
    "kvbridge": 3,
    "mock": 3,
    "north": 4,
    "conformance": 4,
    "client": 5,
    "dynamo": 5,
    "engines": 5,
    "bench": 6,
    "cli": 3,
    "listen_check": 4,
    "run_command": 6,
    "run_options": 5,
    "__main__": 7,
    "__init__": 7,
}

#: third-party top-level module -> the sidecar packages (or single files) allowed to import it.
CONFINED: dict[str, tuple[str, ...]] = {
    # grpclib serves the asyncio programs (simulated engines, engine adapters); the sidecar's
    # own engine client is trio-native
    "grpclib": ("openengine/serving",),
    "h2": ("openengine/serving",),
    "hpack": ("openengine/transport",),
    # dynamo: Dynamo's runtime is asyncio and calls the worker's handler on the loop
    "asyncio": ("openengine/serving", "mock", "bench", "engines", "dynamo"),
    # the one asyncio loop in a sidecar process: Dynamo mode's
    "trio_asyncio": ("dynamo",),
    # the fleet benchmark's anchor is a Dynamo worker of its own (its own process, no sidecar code)
    "dynamo": ("dynamo", "bench/dynamo_anchor.py"),
    "vllm": ("engines",),
    # traces: the SDK is loaded only when tracing is on (sidecar/tracing/otel.py)
    "opentelemetry": ("tracing",),
}


def _modules() -> list[Path]:
    return [p for p in sorted(ROOT.rglob("*.py")) if "_generated" not in p.parts]


def _owner(path: Path) -> str:
    parts = path.relative_to(ROOT).parts
    return parts[0] if len(parts) > 1 else parts[0].removesuffix(".py")


def _imports(path: Path) -> list[str]:
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def test_every_sidecar_package_has_a_rank() -> None:
    owners = {_owner(p) for p in _modules()}
    assert owners <= set(RANK), (
        f"add these to RANK (and to docs/design/architecture.md): {owners - set(RANK)}"
    )


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_point_down_the_layers(path: Path) -> None:
    owner = _owner(path)
    rel = str(path.relative_to(ROOT))
    for name in _imports(path):
        top, _, rest = name.partition(".")
        if top == "sidecar" and rest:
            target = rest.split(".")[0]
            if target != owner:
                assert RANK[target] < RANK[owner], f"{rel} imports {name}: {target} is not below {owner}"
        elif top in CONFINED:
            allowed = CONFINED[top]
            assert owner in allowed or any(rel == a or rel.startswith(a + "/") for a in allowed), (
                f"{rel} imports {name}: only {allowed} may"
            )


#: The packages every request crosses (plus the top-level modules): no two modules of one name.
REQUEST_PATH = ("core", "north", "openengine")


def test_no_two_modules_of_one_name_on_the_request_path() -> None:
    paths = [p for p in _modules() if p.name != "__init__.py"]
    on_path = [p for p in paths if len(p.relative_to(ROOT).parts) == 1 or _owner(p) in REQUEST_PATH]
    names: dict[str, list[str]] = {}
    for p in on_path:
        names.setdefault(p.stem, []).append(str(p.relative_to(ROOT)))
    assert {n: ps for n, ps in names.items() if len(ps) > 1} == {}


def test_no_class_name_is_defined_twice_in_production() -> None:
    """Outside the generated bindings, one class per name (a reader greps for it once)."""
    where: dict[str, list[str]] = {}
    for p in _modules():
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                where.setdefault(node.name, []).append(str(p.relative_to(ROOT)))
    assert {n: ps for n, ps in where.items() if len(ps) > 1} == {}
