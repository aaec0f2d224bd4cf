"""The north protocol as a JSON Schema (draft 2020-12), generated from the typed messages.

Published as ``docs/protocol.schema.json`` (``scripts/gen-schema`` writes it; a test keeps it
equal to :func:`build_schema`) and served at ``GET /v1/schema``. Sources:

- the wire messages (``sidecar.north.wire``) and the sidecar's own answer bodies -- the worker
  card (``sidecar.core.card.WorkerCard``), the load status (``LoadStatus``), the ``health``
  body (``sidecar.core.health.HealthStatus``) -- through ``msgspec.json.schema_components``;
- the OpenEngine messages they embed (a ``generate``'s ``request``, call ``params``, the LoRA
  and ``releaseKvSession`` answers, a ``prefillReady``'s ``kvSession``) from the compiled
  schema the codec uses (``sidecar.north.pbschema``).

Layout: the document validates any one message, either direction (``anyOf`` of
``$defs/ClientMessage`` and ``$defs/ServerMessage``). Per call method ``M``,
``$defs/call.M.params`` and ``$defs/call.M.result`` (the ``body`` of its successful
``result``) -- a ``result`` does not repeat its method, so its ``body`` is checked against
every result there, and against the right one by a client that knows its call. The objects
the sidecar sends are closed (``additionalProperties: false``): the schema served by a
sidecar describes exactly what that build sends.
"""

from __future__ import annotations

import json
from functools import cache
from typing import Final

import betterproto2
import msgspec

from sidecar.core import int64
from sidecar.core.card import LoadStatus, WorkerCard
from sidecar.core.handoff import KvSessionRelease
from sidecar.core.health import HealthStatus
from sidecar.json_types import JSONObject, JSONValue
from sidecar.north import codec, pbschema, wire
from sidecar.openengine import pb

__all__ = ["CALL_RESULT_TYPES", "SCHEMA_ID", "build_schema", "schema_json"]

SCHEMA_ID: Final = "urn:openengine-sidecar:north-protocol:v1"
_DRAFT: Final = "https://json-schema.org/draft/2020-12/schema"
_REF: Final = "#/$defs/{name}"

#: ``call`` method -> type of the ``body`` of its successful ``result``.
CALL_RESULT_TYPES: Final[dict[str, type]] = {
    "describe": WorkerCard,
    "load": LoadStatus,
    "health": HealthStatus,
    "listLoras": pb.ListLorasResponse,
    "loadLora": pb.LoadLoraResponse,
    "unloadLora": pb.UnloadLoraResponse,
    "releaseKvSession": pb.AbortResponse,
}
assert tuple(CALL_RESULT_TYPES) == wire.CALL_METHODS

_CLIENT: Final = (wire.Generate, wire.Cancel, wire.Call)
_SERVER: Final = (wire.Event, wire.Events, wire.End, wire.Result, wire.ProtocolErrorMessage)


def _ref(name: str) -> JSONObject:
    return {"$ref": _REF.format(name=name)}


def _object(node: JSONValue) -> JSONObject:
    """``node``, which this module knows to be a JSON object (a schema)."""
    assert isinstance(node, dict)
    return node


def _substitute(node: JSONValue) -> JSONValue:
    """Apply ``wire.SCHEMA_INSTEAD`` markers (a field whose schema is given, not derived)."""
    if isinstance(node, dict):
        if wire.SCHEMA_INSTEAD in node:
            instead = dict(_object(node[wire.SCHEMA_INSTEAD]))
            if "default" in node:
                instead["default"] = node["default"]
            return instead
        return {k: _substitute(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_substitute(v) for v in node]
    return node


def _params_schema(method: str) -> JSONObject:
    request_type = codec.CALL_REQUEST_TYPES[method]
    if request_type is None:
        return {"type": "object", "maxProperties": 0, "description": f"{method} takes no params"}
    if request_type is KvSessionRelease:
        return _ref(wire.ReleaseKvSessionParams.__name__)
    assert issubclass(request_type, betterproto2.Message)
    return pbschema.ref(request_type, "in")


def _result_schema(method: str) -> JSONObject:
    body = CALL_RESULT_TYPES[method]
    if issubclass(body, betterproto2.Message):
        return pbschema.ref(body, "out")
    return _ref(body.__name__)


@cache
def build_schema() -> JSONObject:
    """The north protocol's JSON Schema (a fresh copy is not made: do not modify it)."""
    struct_types: list[type[msgspec.Struct]] = [
        *_CLIENT,
        wire.ReleaseKvSessionParams,
        *_SERVER,
        WorkerCard,
        LoadStatus,
        HealthStatus,
    ]
    _, components = msgspec.json.schema_components(
        struct_types, schema_hook=int64.schema_hook, ref_template=_REF
    )
    defs = _object(_substitute(components))
    client_names = {t.__name__ for t in (*_CLIENT, wire.ReleaseKvSessionParams)}
    for name, node in defs.items():
        schema = _object(node)
        if name not in client_names and schema.get("type") == "object":
            schema.setdefault("additionalProperties", False)  # what this build sends, nothing else

    pb_roots: list[tuple[type[betterproto2.Message], pbschema.Direction]] = [
        (pb.GenerateRequest, "in"),
        (pb.KvSessionRef, "out"),
    ]
    for method in wire.CALL_METHODS:
        request_type = codec.CALL_REQUEST_TYPES[method]
        if isinstance(request_type, type) and issubclass(request_type, betterproto2.Message):
            pb_roots.append((request_type, "in"))
        body = CALL_RESULT_TYPES[method]
        if issubclass(body, betterproto2.Message):
            pb_roots.append((body, "out"))
        defs[f"call.{method}.params"] = _params_schema(method)
        defs[f"call.{method}.result"] = _result_schema(method)
    defs.update(pbschema.definitions(pb_roots))

    # a call's params are its method's request; a successful result has a body, a failed one an error
    _object(defs["Call"])["allOf"] = [
        {
            "if": {"properties": {"method": {"const": method}}, "required": ["method"]},
            "then": {"properties": {"params": {"anyOf": [_ref(f"call.{method}.params"), {"type": "null"}]}}},
        }
        for method in wire.CALL_METHODS
    ]
    result = _object(defs["Result"])
    _object(result["properties"])["body"] = {"anyOf": [_ref(f"call.{m}.result") for m in wire.CALL_METHODS]}
    result["if"] = {"properties": {"ok": {"const": True}}, "required": ["ok"]}
    result["then"] = {"required": ["body"], "not": {"required": ["error"]}}
    result["else"] = {"required": ["error"], "not": {"required": ["body"]}}
    defs["ClientMessage"] = {"anyOf": [_ref(t.__name__) for t in _CLIENT]}
    defs["ServerMessage"] = {"anyOf": [_ref(t.__name__) for t in _SERVER]}
    return {
        "$schema": _DRAFT,
        "$id": SCHEMA_ID,
        "title": "openengine-sidecar north protocol v1",
        "description": (
            "One WebSocket message of the north protocol (docs/PROTOCOL.md), either direction: "
            "$defs/ClientMessage (client -> sidecar) or $defs/ServerMessage (sidecar -> client). "
            "$defs/call.<method>.params and $defs/call.<method>.result: a call's params and the body "
            "of its successful result; $defs/WorkerCard: GET /v1/worker; $defs/LoadStatus: GET /v1/load. "
            "msgpack frames carry the same shapes (a bytes field may be a msgpack bin)."
        ),
        "anyOf": [_ref("ClientMessage"), _ref("ServerMessage")],
        "$defs": dict(sorted(defs.items())),
    }


@cache
def schema_json() -> bytes:
    """:func:`build_schema` as the bytes of ``docs/protocol.schema.json`` (indented, sorted keys,
    final newline)."""
    return (json.dumps(build_schema(), indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode()
