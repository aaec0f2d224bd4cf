"""Hypothesis strategies for hostile north-protocol input.

- ``json_values``: any JSON value (huge and negative numbers, odd strings, nesting).
- ``pb_json(cls, valid=...)``: the proto3 JSON of an OpenEngine message, built from the
  generated schema (every field, oneofs, maps, enums, 64-bit strings, bytes as base64).
  ``valid=True`` draws only well-typed, in-range values (admission sees them); otherwise a
  share of the fields get wrong types, out-of-range or negative numbers, unknown fields and
  two members of one oneof.
- ``client_messages``: north client messages (generate / cancel / call / anything) with valid
  and invalid ids, metadata, ``kvSessionBytes`` and unknown top-level fields.
- ``frames``: what a client can put in one WebSocket message: JSON text of those messages,
  msgpack of them, deep nesting, truncated and corrupted encodings, arbitrary text and bytes.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import betterproto2
import msgspec
from hypothesis import strategies as st

from sidecar.north import pbjson, wire
from sidecar.openengine import pb
from sidecar.openengine.schema._betterproto2_internals import fields

HUGE_INTS = st.sampled_from(
    [2**31, 2**32, 2**53, 2**53 + 1, 2**63, 2**64, 2**64 + 1, 10**30, -(2**63) - 1, -1]
)
ints = st.one_of(st.integers(-(2**70), 2**70), HUGE_INTS)
finite_floats = st.floats(allow_nan=False, allow_infinity=False)
text = st.one_of(
    st.text(max_size=40),
    st.sampled_from(
        ["", " ", "\x00", "\ud800", "\udfff", "é" * 3, "\u202e", "NaN", "-Infinity", "1e309", "0x10"]
    ),
)

#: Text that can travel in a frame (UTF-8: no lone surrogates); ``text`` may hold them.
utf8_text = st.text(alphabet=st.characters(exclude_categories=["Cs"]), max_size=24)

json_scalars = st.one_of(st.none(), st.booleans(), ints, finite_floats, text)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(text, inner, max_size=4)),
    max_leaves=12,
)
#: JSON values a real frame can carry (UTF-8 strings, 64-bit-safe numbers).
wire_json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), finite_floats, utf8_text),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(utf8_text, inner, max_size=4)),
    max_leaves=12,
)


def deep(levels: int, leaf: Any = 1, *, kind: str = "list") -> Any:
    """``levels`` nested lists (or objects) around ``leaf``."""
    out = leaf
    for _ in range(levels):
        out = [out] if kind == "list" else {"a": out}
    return out


# --- proto3 JSON of OpenEngine messages ------------------------------------------------------------

_FLOAT_TYPES = {betterproto2.TYPE_DOUBLE, betterproto2.TYPE_FLOAT}


def _scalar(proto_type: str, field_cls: Any, valid: bool) -> st.SearchStrategy[Any]:
    if proto_type == betterproto2.TYPE_STRING:
        good: st.SearchStrategy[Any] = utf8_text
    elif proto_type == betterproto2.TYPE_BOOL:
        good = st.booleans()
    elif proto_type in pbjson._INT_RANGES:
        lo, hi = pbjson._INT_RANGES[proto_type]
        small = st.integers(max(lo, 0), min(hi, 4096))
        anyint = st.integers(lo, hi)
        good = st.one_of(small, anyint)
        if proto_type in pbjson._INT64_TYPES:
            good = st.one_of(good, good.map(str))
    elif proto_type in _FLOAT_TYPES:
        good = st.one_of(
            st.floats(0, 2, allow_nan=False), finite_floats, st.sampled_from(["NaN", "Infinity", "-Infinity"])
        )
    elif proto_type == betterproto2.TYPE_BYTES:
        good = st.binary(max_size=16).map(lambda b: base64.b64encode(b).decode())
    elif proto_type == betterproto2.TYPE_ENUM:
        names = [m.proto_name or m.name for m in field_cls]
        good = st.one_of(st.sampled_from(names), st.sampled_from([m.value for m in field_cls]))
    else:  # pragma: no cover - every scalar type is listed above
        raise AssertionError(proto_type)
    if valid:
        return good
    bad: st.SearchStrategy[Any] = st.one_of(
        json_scalars, st.lists(json_scalars, max_size=2), st.just({}), HUGE_INTS, HUGE_INTS.map(str)
    )
    return st.one_of(good, good, good, bad)


def _field_value(
    cls: type[betterproto2.Message], attr: str, valid: bool, depth: int
) -> st.SearchStrategy[Any]:
    f = next(f for f in fields(cls) if f.name == attr)
    field_cls, proto_type, value_field = f.cls, f.proto_type, f.map_value
    if value_field is not None:
        keys = utf8_text if f.map_key_type == betterproto2.TYPE_STRING else st.integers(0, 99).map(str)
        values: st.SearchStrategy[Any]
        if value_field.proto_type == betterproto2.TYPE_MESSAGE:
            values = pb_json(value_field.cls, valid=valid, depth=depth + 1, sparse=True)
        else:
            values = _scalar(value_field.proto_type, value_field.cls, valid)
        one: st.SearchStrategy[Any] = st.dictionaries(keys, values, max_size=3)
    elif proto_type == betterproto2.TYPE_MESSAGE:
        if field_cls in pbjson._WELL_KNOWN_READERS:
            any_json = wire_json_values if valid else json_values
            if field_cls is pb.Struct:
                one = st.dictionaries(utf8_text if valid else text, any_json, max_size=3)
            elif field_cls is pb.ListValue:
                one = st.lists(any_json, max_size=3)
            else:
                one = any_json
        elif depth >= 4:
            one = st.just({})
        else:
            one = pb_json(field_cls, valid=valid, depth=depth + 1, sparse=True)
    else:
        one = _scalar(proto_type, field_cls, valid)
    if f.repeated and value_field is None:
        return st.lists(one, max_size=3)
    return one


@st.composite
def _message(
    draw: st.DrawFn, cls: type[betterproto2.Message], valid: bool, depth: int, sparse: bool
) -> dict[str, Any]:
    plan = pbjson._plan(cls)
    out: dict[str, Any] = {}
    used_groups: set[str] = set()
    for f in plan.fields:
        if draw(st.integers(0, 4 if sparse else 1)) != 0:
            continue
        if f.group is not None:
            if f.group in used_groups and (valid or draw(st.integers(0, 9)) != 0):
                continue  # at most one member of a oneof (sometimes two, when invalid)
            used_groups.add(f.group)
        name = f.json_name if valid or draw(st.integers(0, 9)) else f.attr  # snake_case is accepted too
        out[name] = draw(_field_value(cls, f.attr, valid, depth))
    if not valid and draw(st.integers(0, 14)) == 0:
        out[draw(st.text(min_size=1, max_size=10))] = draw(json_scalars)  # unknown field (usually)
    return out


def pb_json(
    cls: type[betterproto2.Message], *, valid: bool = True, depth: int = 0, sparse: bool = False
) -> st.SearchStrategy[dict[str, Any]]:
    """The proto3 JSON of ``cls`` (see module doc); ``sparse``: each field present with
    probability 1/5 instead of 1/2 (requests that pass admission more often)."""
    return _message(cls, valid, depth, sparse)


# --- north client messages --------------------------------------------------------------------------

valid_ids = st.one_of(st.integers(0, wire.MAX_ID_INT), st.text(min_size=1, max_size=wire.MAX_ID_LENGTH))
bad_ids = st.one_of(
    st.just(""),
    st.integers(max_value=-1),
    st.integers(min_value=wire.MAX_ID_INT + 1),
    st.text(min_size=wire.MAX_ID_LENGTH + 1, max_size=wire.MAX_ID_LENGTH + 4),
    st.none(),
    st.booleans(),
    finite_floats,
    st.lists(st.integers(), max_size=2),
)
ids = st.one_of(valid_ids, valid_ids, bad_ids)
metadata_keys = st.one_of(
    st.sampled_from(
        [
            "openengine-routing-key",
            "openengine-target-dp-rank",
            "openengine-priority",
            "traceparent",
            "tracestate",
            "openengine-bogus",
            "grpc-timeout",
            "x-bin",
            "te",
            "connection",
            "Upper-Case",
        ]
    ),
    st.text(max_size=12),
)
metadata = st.dictionaries(
    metadata_keys, st.one_of(st.text(max_size=20), st.integers(-5, 2**40).map(str)), max_size=5
)


@st.composite
def generate_messages(draw: st.DrawFn, *, valid_request: bool | None = None) -> dict[str, Any]:
    valid = draw(st.booleans()) if valid_request is None else valid_request
    request = draw(pb_json(pb.GenerateRequest, valid=valid, sparse=draw(st.booleans())))
    msg: dict[str, Any] = {"type": "generate", "stream": draw(ids), "request": request}
    if draw(st.booleans()):
        msg["metadata"] = draw(st.one_of(metadata, metadata, json_values))
    if draw(st.integers(0, 5)) == 0:
        msg["kvSessionBytes"] = draw(
            st.one_of(
                st.binary(max_size=24).map(lambda b: base64.b64encode(b).decode()),
                st.builds(lambda m: base64.b64encode(bytes(pb.KvSessionRef(**m))).decode(), st.just({})),
                text,
                json_scalars,
            )
        )
    if draw(st.integers(0, 9)) == 0:
        msg[draw(st.text(min_size=1, max_size=8))] = draw(json_scalars)
    if draw(st.integers(0, 9)) == 0:
        del msg[draw(st.sampled_from(sorted(msg)))]
    return msg


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@st.composite
def call_messages(draw: st.DrawFn) -> dict[str, Any]:
    method = draw(st.one_of(st.sampled_from(list(wire.CALL_METHODS)), text))
    msg: dict[str, Any] = {"type": "call", "call": draw(ids), "method": method}
    if draw(st.booleans()):
        request_type = {
            "load": pb.GetLoadRequest,
            "health": pb.HealthRequest,
            "listLoras": pb.ListLorasRequest,
            "loadLora": pb.LoadLoraRequest,
            "unloadLora": pb.UnloadLoraRequest,
        }.get(method)
        if method == "releaseKvSession" and draw(st.booleans()):
            msg["params"] = {"kvSessionBytes": draw(st.one_of(st.binary(max_size=40).map(_b64), text))}
        else:
            msg["params"] = draw(pb_json(request_type, valid=False)) if request_type else draw(json_values)  # type: ignore[arg-type]
    return msg


client_messages = st.one_of(
    generate_messages(),
    st.fixed_dictionaries({"type": st.just("cancel"), "stream": ids}),
    call_messages(),
    st.dictionaries(
        st.sampled_from(["type", "stream", "call", "request", "method"]), json_values, max_size=4
    ),
    json_values,
)


# --- frames -------------------------------------------------------------------------------------------


def _json_text(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, allow_nan=True)


def _msgpack(value: Any) -> bytes:
    try:
        return msgspec.msgpack.encode(value)
    except (OverflowError, msgspec.EncodeError, UnicodeEncodeError):
        return b"\xc1"  # never-used msgpack byte: undecodable


@st.composite
def _corrupted(draw: st.DrawFn, base: bytes) -> bytes:
    data = bytearray(base)
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(["flip", "cut", "insert"]))
        if op == "cut" and data:
            data = data[: draw(st.integers(0, len(data) - 1))]
        elif op == "flip" and data:
            i = draw(st.integers(0, len(data) - 1))
            data[i] ^= 1 << draw(st.integers(0, 7))
        else:
            i = draw(st.integers(0, len(data)))
            data[i:i] = draw(st.binary(min_size=1, max_size=4))
    return bytes(data)


text_frames = st.one_of(
    client_messages.map(_json_text),
    client_messages.map(_json_text).flatmap(
        lambda t: _corrupted(t.encode("utf-8", "surrogatepass")).map(
            lambda b: b.decode("utf-8", "surrogateescape")
        )
    ),
    st.integers(1, 400).map(lambda n: "[" * n + "]" * n),
    st.integers(30, 200).map(
        lambda n: _json_text({"type": "generate", "stream": 1, "request": {"extra": deep(n, kind="dict")}})
    ),
    st.text(max_size=60),
)
binary_frames = st.one_of(
    client_messages.map(_msgpack),
    client_messages.map(_msgpack).flatmap(_corrupted),
    st.integers(1, 400).map(lambda n: b"\x91" * n + b"\x01"),
    st.binary(max_size=60),
)
frames = st.one_of(text_frames, binary_frames)
