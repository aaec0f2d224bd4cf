"""Wire round trips of the generated bindings, cross-checked with the reference protobuf runtime.

The reference runtime (google.protobuf, via grpcio-tools' protoc) is compiled from our own
schema/ at test time, so these tests prove that betterproto2 bytes are what any other
OpenEngine implementation reads and writes.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import betterproto2
import pytest

from sidecar.openengine import pb
from sidecar.openengine.engine_errors import wire_name
from sidecar.openengine.schema._betterproto2_internals import Field, fields

ROOT = Path(__file__).resolve().parents[2]
U64_MAX = 2**64 - 1


@pytest.fixture(scope="module")
def ref(tmp_path_factory: pytest.TempPathFactory) -> ModuleType:
    """The reference (google.protobuf) modules for our schema, as one namespace."""
    out = tmp_path_factory.mktemp("ref")
    protos = sorted(
        str(p.relative_to(ROOT / "schema")) for p in (ROOT / "schema/openengine/v1").glob("*.proto")
    )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-I",
            str(ROOT / "schema"),
            f"--python_out={out}",
            *protos,
        ],
        check=True,
    )
    sys.path.insert(0, str(out))
    try:
        ns = ModuleType("ref")
        for p in protos:
            mod = importlib.import_module(p.removesuffix(".proto").replace("/", ".") + "_pb2")
            for name in dir(mod):
                if not name.startswith("_"):
                    setattr(ns, name, getattr(mod, name))
        return ns
    finally:
        sys.path.remove(str(out))


SCALARS: dict[str, Any] = {
    "string": "s\u00e9",
    "bytes": b"\x00\xffraw",
    "bool": True,
    "uint32": 2**32 - 1,
    "int32": -(2**31),
    "uint64": U64_MAX,
    "int64": -(2**63),
    "double": 0.25,
}


def message_classes() -> list[type[betterproto2.Message]]:
    out = []
    for name in pb.__all__:
        obj = getattr(pb, name)
        if isinstance(obj, type) and issubclass(obj, betterproto2.Message) and obj.__module__.endswith("v1"):
            out.append(obj)
    return out


def populate(cls: type[betterproto2.Message], depth: int = 0, oneof_pick: int = 0) -> betterproto2.Message:
    """An instance with every field set (for each oneof group: its ``oneof_pick``-th member)."""
    kwargs: dict[str, Any] = {}
    groups: dict[str, list[str]] = {}
    for f in fields(cls):
        if f.group:
            groups.setdefault(f.group, []).append(f.name)
    chosen = {members[oneof_pick % len(members)] for members in groups.values()}
    for f in fields(cls):
        if f.group and f.name not in chosen:
            continue
        value = field_value(f, depth)
        if value is not None:
            kwargs[f.name] = [value, value] if f.repeated else value
    return cls(**kwargs)


def field_value(f: Field, depth: int) -> Any:
    if f.proto_type in SCALARS:
        return SCALARS[f.proto_type]
    if f.proto_type == "enum":
        return list(f.cls)[-1]  # type: ignore[call-overload]
    if f.proto_type == "message":
        if f.cls is pb.Struct:
            return pb.Struct.from_dict({"k": [1.5, None, True, "x", {"n": "18446744073709551615"}]})
        if depth > 3:
            return None
        return populate(f.cls, depth + 1)
    raise AssertionError(f"unhandled proto type {f.proto_type}")


def oneof_sizes(cls: Any) -> int:
    sizes: dict[str, int] = {}
    for f in fields(cls):
        if f.group:
            sizes[f.group] = sizes.get(f.group, 0) + 1
    return max(sizes.values(), default=1)


CASES = [(cls, k) for cls in message_classes() for k in range(oneof_sizes(cls))]


def test_every_message_class_is_covered() -> None:
    import re

    names = {cls.__name__ for cls, _ in CASES}
    declared = {
        m
        for p in (ROOT / "schema/openengine/v1").glob("*.proto")
        for m in re.findall(r"^message (\w+)", p.read_text(), re.M)
    }
    assert names == declared


@pytest.mark.parametrize(("cls", "pick"), CASES, ids=[f"{c.__name__}-{k}" for c, k in CASES])
def test_round_trip_matches_reference(ref: ModuleType, cls: type[betterproto2.Message], pick: int) -> None:
    msg = populate(cls, oneof_pick=pick)
    data = bytes(msg)
    assert cls.parse(data) == msg
    other = getattr(ref, cls.__name__)()
    other.ParseFromString(data)
    assert other.ByteSize() > 0 or data == b""
    assert cls.parse(other.SerializeToString(deterministic=True)) == msg


def test_optional_presence_survives(ref: ModuleType) -> None:
    caps = pb.DeploymentCapacity(kv_block_size=0, max_loras=None)
    back = pb.DeploymentCapacity.parse(bytes(caps))
    assert back.kv_block_size == 0 and back.max_loras is None
    other = ref.DeploymentCapacity.FromString(bytes(caps))
    assert other.HasField("kv_block_size") and not other.HasField("max_loras")
    flags = pb.GenerationCapabilities(supports_priority=False)
    assert pb.GenerationCapabilities.parse(bytes(flags)).supports_priority is False
    assert pb.GenerationCapabilities.parse(bytes(pb.GenerationCapabilities())).supports_priority is None


def test_oneofs(ref: ModuleType) -> None:
    resp = pb.GenerateResponse(request_id="r", token=pb.TokenOutput(output_index=0))
    assert betterproto2.which_one_of(pb.GenerateResponse.parse(bytes(resp)), "event")[0] == "token"
    empty_token = pb.GenerateResponse(token=pb.TokenOutput())
    assert betterproto2.which_one_of(pb.GenerateResponse.parse(bytes(empty_token)), "event")[0] == "token"
    assert ref.GenerateResponse.FromString(bytes(empty_token)).WhichOneof("event") == "token"
    abort_all = pb.AbortRequest(all_requests=pb.AllRequests())
    assert ref.AbortRequest.FromString(bytes(abort_all)).WhichOneof("target") == "all_requests"
    sel = pb.CandidateTokenSelection(top_n=0)
    assert betterproto2.which_one_of(pb.CandidateTokenSelection.parse(bytes(sel)), "selection") == (
        "top_n",
        0,
    )


def test_struct_keeps_json_types(ref: ModuleType) -> None:
    attrs = {
        "remote_block_ids": [1.0, 2.0, 3.0],
        "do_remote_decode": True,
        "nothing": None,
        "nested": {"list": [[], {"a": "b"}], "f": 0.5},
        "ctx_request_id": str(2**63 + 11),
    }
    ref_msg = pb.KvSessionRef(attributes_struct=pb.Struct.from_dict(attrs))
    back = pb.KvSessionRef.parse(bytes(ref_msg))
    assert back.attributes_struct.to_dict() == attrs
    other = ref.KvSessionRef.FromString(bytes(ref_msg))
    from google.protobuf import json_format

    assert json_format.MessageToDict(other.attributes_struct) == attrs


def test_room_id_full_uint64(ref: ModuleType) -> None:
    boot = pb.KvBootstrap(endpoint=pb.KvEndpoint(host="10.0.0.1", port=8998), room_id=U64_MAX)
    assert pb.KvBootstrap.parse(bytes(boot)).room_id == U64_MAX
    assert ref.KvBootstrap.FromString(bytes(boot)).room_id == U64_MAX


def test_bytes_fields(ref: ModuleType) -> None:
    item = pb.MediaItem(modality=pb.Modality.IMAGE, raw_bytes=bytes(range(256)))
    assert pb.MediaItem.parse(bytes(item)).raw_bytes == bytes(range(256))
    h = pb.KvBlockHash(value=(U64_MAX).to_bytes(8, "big"), encoding="bytes")
    assert ref.KvBlockHash.FromString(bytes(h)).value == b"\xff" * 8


def test_unknown_field_survives_parse_and_serialize(ref: ModuleType) -> None:
    session = pb.KvSessionRef(session_id="s1", dp_rank=1, handoff_profile="vllm.kv_transfer_params.v1")
    # field 99 (length-delimited) and field 100 (varint): fields of a newer schema revision
    unknown = b"\x9a\x06\x05hello" + b"\xa0\x06\x2a"
    data = bytes(session) + unknown
    parsed = pb.KvSessionRef.parse(data)
    assert parsed.session_id == "s1"
    assert bytes(parsed) == data
    wrapped = pb.GenerateRequest(request_id="r", kv=pb.KvOptions(session=parsed))
    again = pb.GenerateRequest.parse(bytes(wrapped))
    assert bytes(again.kv.session) == data


def test_unknown_enum_value_reads_as_unknown_not_error() -> None:
    # GenerateResponse.error.code = 99 (a future ErrorCode)
    data = b"\x0a\x01r\x32\x02\x08\x63"
    resp = pb.GenerateResponse.parse(data)
    assert int(resp.error.code) == 99
    assert wire_name(resp.error.code) == "ERROR_CODE_UNSPECIFIED"
    assert wire_name(pb.ErrorCode.DRAINING) == "ERROR_CODE_DRAINING"
