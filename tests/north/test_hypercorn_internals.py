"""The guard of ``sidecar.north._hypercorn_internals``: what the HTTP listener relies on in
hypercorn beyond its documented ``serve`` exists in the installed release (a release that moves
or renames it fails here, not in production), and no other sidecar module imports hypercorn."""

from __future__ import annotations

import ast
from importlib.metadata import version
from pathlib import Path

import hypercorn.trio.run
import hypercorn.trio.tcp_server

from sidecar.north import _hypercorn_internals as internals

SIDECAR = Path(internals.__file__).parents[1]


def test_pinned_hypercorn_series() -> None:
    # the internals module replaces hypercorn's trio classes: review it before moving the pin
    assert version("hypercorn").startswith("0.18."), version("hypercorn")


def test_everything_relied_on_exists() -> None:
    assert internals.missing_internals() == []


def test_install_replaces_the_trio_worker_classes() -> None:
    internals.install()
    internals.install()  # idempotent
    assert hypercorn.trio.tcp_server.ProtocolWrapper is internals.GuardedProtocol
    assert hypercorn.trio.run.TCPServer is internals.CountedServer


def test_no_other_module_imports_hypercorn() -> None:
    found = []
    for path in sorted(SIDECAR.rglob("*.py")):
        if path.name == "_hypercorn_internals.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            found += [
                f"{path.relative_to(SIDECAR)}:{node.lineno}" for n in names if n.split(".")[0] == "hypercorn"
            ]
    assert found == [], found
