"""The guard of sidecar/openengine/schema/_betterproto2_internals.py: the betterproto2 internals the
sidecar uses, and the behaviour relied on. A release that renames or changes them fails here
(and then only that module needs changing)."""

from __future__ import annotations

import ast
from pathlib import Path

import betterproto2

from sidecar.openengine import pb
from sidecar.openengine.schema import _betterproto2_internals as internals
from sidecar.openengine.schema._betterproto2_internals import (
    fields,
    fields_by_number,
    missing_internals,
    set_unknown_fields,
    unknown_fields,
)
from sidecar.openengine.schema.protobuf_wire import length_delimited


def test_no_internal_is_missing() -> None:
    assert missing_internals() == []


def test_the_field_table_describes_the_schema() -> None:
    by_name = {f.name: f for f in fields(pb.KvSessionRef)}
    assert [f.number for f in fields(pb.KvSessionRef)] == sorted(f.number for f in fields(pb.KvSessionRef))
    assert (by_name["session_id"].number, by_name["session_id"].proto_type) == (1, betterproto2.TYPE_STRING)
    assert by_name["endpoints"].repeated and by_name["endpoints"].cls is pb.KvEndpoint
    response = fields_by_number(pb.GenerateResponse)
    assert response[4].name == "prefill_ready" and response[4].group == "event"
    assert response[4].cls is pb.PrefillReady and response[4].default is not None
    (struct_fields,) = fields(pb.Struct)  # map<string, Value>
    assert struct_fields.proto_type == betterproto2.TYPE_MAP
    assert struct_fields.map_key_type == betterproto2.TYPE_STRING
    assert struct_fields.map_value is not None and struct_fields.map_value.cls is pb.Value


def test_unknown_fields_survive_parse_and_serialise() -> None:
    extra = length_delimited(100, b"from-a-newer-revision")
    parsed = pb.KvSessionRef.parse(bytes(pb.KvSessionRef(session_id="s")) + extra)
    assert unknown_fields(parsed) == extra
    assert bytes(parsed).endswith(extra)


def test_set_unknown_fields_are_written_verbatim() -> None:
    kv = pb.KvOptions(cache_salt="x")
    raw = length_delimited(1, b"\x0a\x01s\xa8\x06\x01")  # field 1 (session), bytes not re-encoded
    set_unknown_fields(kv, raw)
    assert bytes(kv) == bytes(pb.KvOptions(cache_salt="x")) + raw
    assert unknown_fields(pb.KvOptions()) == b""


def test_no_other_module_names_a_betterproto2_internal() -> None:
    """``_unknown_fields`` and ``_betterproto`` are read and written through this module only."""
    root = Path(internals.__file__).parents[1]
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.name == "_betterproto2_internals.py" or "_generated" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr in ("_unknown_fields", "_betterproto"):
                found.append(f"{path.relative_to(root)}:{node.lineno}")
    assert found == [], found
