"""struct_wire (Struct bytes -> proto3 JSON without betterproto2) and split_load_info."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.core.load import MalformedLoadInfo, attributes_dict, split_load_info
from sidecar.core.struct_wire import StructWireError, struct_to_dict
from sidecar.openengine import pb

_scalars = (
    st.none()
    | st.booleans()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.integers(min_value=-(2**53), max_value=2**53)
    | st.text(max_size=20)
)
_json: Any = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
    max_leaves=30,
)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.text(max_size=10), _json, max_size=6))
def test_same_as_betterproto2(d: dict[str, Any]) -> None:
    data = bytes(pb.Struct.from_dict(d))
    assert struct_to_dict(data) == pb.Struct.parse(data).to_dict()


def test_values() -> None:
    d = {"n": None, "t": True, "f": False, "x": 1.5, "s": "é", "l": [1, [], {}], "o": {"a": {"b": [None]}}}
    assert struct_to_dict(bytes(pb.Struct.from_dict(d))) == {
        "n": None,
        "t": True,
        "f": False,
        "x": 1.5,
        "s": "é",
        "l": [1.0, [], {}],
        "o": {"a": {"b": [None]}},
    }
    assert struct_to_dict(b"") == {}


@pytest.mark.parametrize(
    "bad",
    [
        b"\x0a",  # truncated length
        b"\x0a\x05\x0a\x01a",  # entry longer than the data
        b"\x0a\x04\x0a\x02\xff\xfe",  # invalid utf-8 key
        b"\x0a\x06\x0a\x01a\x12\x01\x11",  # number_value truncated
        b"\x0b",  # wire type 3 (groups)
    ],
)
def test_malformed(bad: bytes) -> None:
    with pytest.raises(StructWireError):
        struct_to_dict(bad)


def test_nesting_is_bounded() -> None:
    value: Any = 1
    for _ in range(80):
        value = {"a": value}
    data = bytes(pb.Struct.from_dict(value))
    with pytest.raises(StructWireError):
        struct_to_dict(data)


def test_split_load_info() -> None:
    info = pb.LoadInfo(
        instance_id="i",
        running_requests=3,
        used_kv_blocks=2**40,
        ranks=[pb.RankLoadInfo(data_parallel_rank=1, queued_requests=2)],
        attributes=pb.Struct.from_dict({"a": 1, "b": {"c": "d"}}),
    )
    rest, raw = split_load_info(bytes(info))
    assert raw is not None and attributes_dict(raw) == {"a": 1.0, "b": {"c": "d"}}
    assert rest.attributes is None
    info.attributes = None
    assert rest == info
    assert split_load_info(bytes(info)) == (info, None)
    assert attributes_dict(None) is None


def test_split_load_info_malformed() -> None:
    with pytest.raises(MalformedLoadInfo):
        split_load_info(b"\x0a\x09ab")  # truncated instance_id
    with pytest.raises(MalformedLoadInfo):
        split_load_info(b"\xf2\x01\x05\x0a")  # truncated attributes
    with pytest.raises(MalformedLoadInfo):
        attributes_dict(b"\x0a")


def test_nan_and_infinity() -> None:
    data = bytes(pb.Struct(fields={"x": pb.Value(number_value=math.inf)}))
    assert struct_to_dict(data) == {"x": math.inf}
