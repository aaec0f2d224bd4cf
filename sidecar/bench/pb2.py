"""The official protobuf/grpcio bindings of our schema, generated at run time (never committed).

``generate_pb2(dest)`` runs ``grpc_tools.protoc`` (the dev dependency grpcio-tools) on
``schema/openengine/v1/*.proto`` into ``dest``; ``import_pb2(dest)`` puts ``dest`` first on
``sys.path`` and returns the ``generation_pb2`` and ``openengine_pb2_grpc`` modules.
Raises :class:`Pb2Unavailable` when grpcio-tools or the schema is missing.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = ROOT / "schema"


class Pb2Unavailable(Exception):
    """The grpcio anchor cannot run here (no grpcio-tools / grpcio / schema)."""


def generate_pb2(dest: str | Path) -> Path:
    try:
        import grpc_tools
        from grpc_tools import protoc
    except ImportError as err:
        raise Pb2Unavailable(f"grpcio-tools is not installed ({err}); pip install -e '.[dev]'") from None
    protos = sorted((SCHEMA / "openengine" / "v1").glob("*.proto"))
    if not protos:
        raise Pb2Unavailable(f"no .proto files under {SCHEMA}")
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    include = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
    args = ["protoc", f"-I{SCHEMA}", f"-I{include}", f"--python_out={dest}", f"--grpc_python_out={dest}"]
    if protoc.main([*args, *map(str, protos)]) != 0:
        raise Pb2Unavailable("grpc_tools.protoc failed on schema/")
    return dest


def import_pb2(dest: str | Path) -> tuple[ModuleType, ModuleType]:
    """(``openengine.v1.generation_pb2``, ``openengine.v1.openengine_pb2_grpc``) from ``dest``."""
    sys.path.insert(0, str(dest))
    try:
        gen = importlib.import_module("openengine.v1.generation_pb2")
        svc = importlib.import_module("openengine.v1.openengine_pb2_grpc")
    except ImportError as err:
        raise Pb2Unavailable(f"cannot import the generated bindings: {err}") from None
    return gen, svc
