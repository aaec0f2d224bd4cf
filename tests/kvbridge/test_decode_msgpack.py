"""ZMQ msgpack payloads -> normalized events -> output payload (checked by the independent decoder)."""

from __future__ import annotations

import random

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.kvbridge.decode_msgpack import MsgpackBatchDecoder, decode_msgpack_batch
from sidecar.kvbridge.errors import KvDecodeError
from sidecar.kvbridge.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    decode_output_batch,
    encode_batch,
)
from tests.kvbridge import gen
from tests.kvbridge.consumer import decode_payload
from tests.kvbridge.fake_zmq_engine import encode_wire

STYLES = ["vllm-map", "vllm-array", "sglang", "sglang-array"]
U64_MAX = (1 << 64) - 1


def roundtrip(payload: bytes, rank: int | None = 0) -> tuple[float, list[dict], int | None]:
    """Decode with the bridge, re-encode as output, decode independently."""
    batch = decode_msgpack_batch(payload)
    batch.data_parallel_rank = rank
    return decode_payload(encode_batch(batch))


#: (style, hash kind) pairs an engine can send: SGLang hashes are always ints.
STYLE_HASHES = [
    (s, h) for s in STYLES for h in ("int", "bytes") if not (h == "bytes" and s.startswith("sglang"))
]


@pytest.mark.parametrize(("style", "hash_kind"), STYLE_HASHES)
@pytest.mark.parametrize("negative", [False, True])
def test_every_style_roundtrips_exactly(style: str, hash_kind: str, negative: bool) -> None:
    rng = random.Random(f"{style}{hash_kind}{negative}")
    decoder = MsgpackBatchDecoder()
    for _ in range(30):
        events = gen.batch(rng, rng.randint(0, 20), hash_kind=hash_kind, style=style)
        payload = encode_wire(events, style, rank=3, ts=12.5, negative=negative)
        batch = decoder.decode(payload)
        assert batch.ts == 12.5
        assert batch.data_parallel_rank == (None if style == "sglang-array" else 3)
        batch.data_parallel_rank = 3
        ts, out, rank = decode_payload(encode_batch(batch))
        assert (ts, rank) == (12.5, 3)
        assert out == events


def test_vllm_map_with_every_field() -> None:
    ev = {
        "type": "BlockStored",
        "block_hashes": [U64_MAX, 1 << 63, 7],
        "parent_block_hash": U64_MAX - 1,
        "token_ids": list(range(6)),
        "block_size": 2,
        "lora_id": 4,
        "medium": "GPU",
        "lora_name": "ad",
        "extra_keys": [["mm:1", 0], None, [["nested", 1], "salt"]],
        "group_idx": 2,
        "kv_cache_spec_kind": "sliding_window",
        "kv_cache_spec_sliding_window": 128,
    }
    payload = msgspec.msgpack.encode([1.0, [ev], 0])
    batch = decode_msgpack_batch(payload)
    (stored,) = batch.events
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == [U64_MAX, 1 << 63, 7]
    assert stored.parent_block_hash == U64_MAX - 1
    assert stored.extra_keys == [["mm:1", 0], None, [["nested", 1], "salt"]]
    assert roundtrip(payload)[1] == [ev]


def test_tagged_arrays_full_and_truncated() -> None:
    full = ["BlockStored", [1, 2], None, [1, 2, 3, 4], 2, None, "GPU", None, None, 1, "full", 0]
    old_sglang = ["BlockStored", [5], 4, [9], 1, None]  # 5 fields: no medium / lora_name
    removed_old = ["BlockRemoved", [5]]
    payload = msgspec.msgpack.encode([2, [full, old_sglang, removed_old, ["AllBlocksCleared"]]])
    batch = decode_msgpack_batch(payload)
    assert batch.ts == 2.0 and batch.data_parallel_rank is None
    a, b, c, d = batch.events
    assert isinstance(a, BlockStored) and a.group_idx == 1 and a.kv_cache_spec_kind == "full"
    assert a.kv_cache_spec_sliding_window == 0  # a present zero stays a zero
    assert isinstance(b, BlockStored) and b.parent_block_hash == 4 and b.medium is None
    assert isinstance(c, BlockRemoved) and c.block_hashes == [5] and c.medium is None
    assert isinstance(d, AllBlocksCleared)


def test_unknown_trailing_array_fields_and_map_keys_are_ignored() -> None:
    arr = ["BlockRemoved", [1], "GPU", 0, "future", {"x": 1}]
    mp = {"type": "BlockRemoved", "block_hashes": [2], "medium": "CPU_PINNED", "future_field": [1]}
    batch = decode_msgpack_batch(msgspec.msgpack.encode([0.5, [arr, mp], 1]))
    assert [e.block_hashes for e in batch.events] == [[1], [2]]  # type: ignore[union-attr]


def test_sglang_metadata_in_lora_name_slot_both_forms() -> None:
    meta = {"cache_salt": "abc", "session_id": "s1"}
    as_map = {
        "type": "BlockStored",
        "block_hashes": [1],
        "token_ids": [3],
        "block_size": 1,
        "lora_name": meta,
    }
    as_arr = ["BlockStored", [1], None, [3], 1, None, "GPU", meta]
    explicit = {
        "type": "BlockStored",
        "block_hashes": [1],
        "token_ids": [3],
        "block_size": 1,
        "metadata": meta,
    }
    for ev in (as_map, as_arr, explicit):
        (out,) = decode_msgpack_batch(msgspec.msgpack.encode([0.0, [ev], 0])).events
        assert isinstance(out, BlockStored)
        assert out.metadata == meta and out.lora_name is None


def test_mixed_maps_and_arrays_in_one_batch_and_map_batch() -> None:
    events = [{"type": "BlockRemoved", "block_hashes": [b"\x00" * 32], "medium": None}, ["AllBlocksCleared"]]
    batch = decode_msgpack_batch(msgspec.msgpack.encode([1.5, events, 2]))
    assert isinstance(batch.events[0], BlockRemoved) and batch.events[0].block_hashes == [b"\x00" * 32]
    assert isinstance(batch.events[1], AllBlocksCleared)
    as_map = {"ts": 3, "events": events, "attn_dp_rank": 5}
    batch = decode_msgpack_batch(msgspec.msgpack.encode(as_map))
    assert batch.ts == 3.0 and batch.data_parallel_rank == 5 and len(batch.events) == 2


def test_negative_int64_hash_becomes_unsigned() -> None:
    ev = ["BlockStored", [-1, -(1 << 63)], -2, [1], 1, None, "GPU", None]
    (out,) = decode_msgpack_batch(msgspec.msgpack.encode([0.0, [ev], 0])).events
    assert isinstance(out, BlockStored)
    assert out.block_hashes == [U64_MAX, 1 << 63] and out.parent_block_hash == U64_MAX - 1


def test_decoder_adapts_to_the_source_shape_and_back() -> None:
    decoder = MsgpackBatchDecoder()
    m = msgspec.msgpack.encode([0.0, [{"type": "AllBlocksCleared"}], 0])
    a = msgspec.msgpack.encode([0.0, [["AllBlocksCleared"]], 0])
    for p in (a, a, m, a, m, m):
        assert decoder.decode(p).events == [AllBlocksCleared()]


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",  # never-used msgpack byte
        msgspec.msgpack.encode("text"),
        msgspec.msgpack.encode([1.0]),
        msgspec.msgpack.encode(["ts", []]),
        msgspec.msgpack.encode([1.0, {"not": "a list"}]),
        msgspec.msgpack.encode([1.0, [["Unknown", 1]]]),
        msgspec.msgpack.encode([1.0, [{"type": "BlockStored"}]]),  # no block_hashes
        msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved", "block_hashes": ["str"]}]]),
        msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, ["x"], 1]]]),
        msgspec.msgpack.encode([1.0, [7]]),
        msgspec.msgpack.encode([1.0, [], "rank"]),
        msgspec.msgpack.encode([True, []]),
    ],
)
def test_malformed_payloads_raise_typed_error(payload: bytes) -> None:
    with pytest.raises(KvDecodeError):
        decode_msgpack_batch(payload)


def test_output_encoding_shape() -> None:
    batch = EventBatch(
        1.25,
        [
            BlockStored([U64_MAX], None, [1], 1, None, "GPU", None),
            BlockStored([b"\x01\x02"], b"\x03", [1], 1, 2, None, "l", group_idx=0),
            BlockRemoved([5], None),
            AllBlocksCleared(),
        ],
        0,
    )
    raw = msgspec.msgpack.decode(encode_batch(batch))
    assert raw[0] == 1.25 and raw[2] == 0
    assert raw[1][0] == {
        "type": "BlockStored",
        "block_hashes": [U64_MAX],
        "parent_block_hash": None,
        "token_ids": [1],
        "block_size": 1,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }
    assert raw[1][1]["group_idx"] == 0  # a reported zero is kept
    assert raw[1][2] == {"type": "BlockRemoved", "block_hashes": [5], "medium": None}
    assert raw[1][3] == {"type": "AllBlocksCleared"}
    assert decode_output_batch(encode_batch(batch)) == batch


_hash = st.one_of(st.integers(0, U64_MAX), st.binary(min_size=1, max_size=32))
_stored = st.builds(
    lambda hs, parent, bs, lora, medium, extra, g: {
        "type": "BlockStored",
        "block_hashes": hs,
        "parent_block_hash": parent,
        "token_ids": list(range(bs * len(hs))),
        "block_size": bs,
        "lora_id": lora,
        "medium": medium,
        "lora_name": None if lora is None else f"l{lora}",
        **({"extra_keys": [[e] if e is not None else None for e in extra[: len(hs)]]} if extra else {}),
        **({"group_idx": g} if g is not None else {}),
    },
    st.lists(_hash, min_size=1, max_size=4),
    st.one_of(st.none(), _hash),
    st.integers(1, 4),
    st.one_of(st.none(), st.integers(1, 1 << 40)),
    st.sampled_from(gen.MEDIA),
    st.lists(st.one_of(st.none(), st.text(max_size=5), st.integers(-5, 5)), max_size=4),
    st.one_of(st.none(), st.integers(0, 5)),
)
_removed = st.builds(
    lambda hs, medium: {"type": "BlockRemoved", "block_hashes": hs, "medium": medium},
    st.lists(_hash, min_size=1, max_size=4),
    st.sampled_from(gen.MEDIA),
)
_events = st.lists(st.one_of(_stored, _removed, st.just({"type": "AllBlocksCleared"})), max_size=20)


@settings(max_examples=150, deadline=None)
@given(events=_events, style=st.sampled_from(["vllm-map", "vllm-array"]), ts=st.floats(0, 2e9))
def test_property_decode_encode_is_lossless(events: list[dict], style: str, ts: float) -> None:
    assert roundtrip(encode_wire(events, style, rank=1, ts=ts), rank=1) == (ts, events, 1)


def test_optional_fields_placeholders_and_explicit_nones() -> None:
    arr = ["BlockStored", [1], None, [1], 1, None, "GPU", None, None, 3]  # extra_keys slot is a placeholder
    mp = {"type": "BlockStored", "block_hashes": [2], "extra_keys": None, "group_idx": None}
    rm = ["BlockRemoved", [3], None, None]
    _, out, _ = roundtrip(msgspec.msgpack.encode([0.0, [arr, mp, rm], 0]))
    assert "extra_keys" not in out[0] and out[0]["group_idx"] == 3
    assert out[1]["extra_keys"] is None and out[1]["group_idx"] is None  # an engine's explicit None is kept
    assert out[2] == {"type": "BlockRemoved", "block_hashes": [3], "medium": None}


def test_vllm_maps_decode_straight_into_the_output_model() -> None:
    decoder = MsgpackBatchDecoder()
    ev = {
        "type": "BlockStored",
        "block_hashes": [1],
        "parent_block_hash": None,
        "token_ids": [5],
        "block_size": 1,
    }
    batch = decoder.decode(msgspec.msgpack.encode([0.0, [ev], 0]))
    assert type(batch.events[0]) is BlockStored and decoder._last == 0  # the fast path
    neg = {**ev, "block_hashes": [-1]}
    assert decoder.decode(msgspec.msgpack.encode([0.0, [neg], 0])).events[0].block_hashes == [U64_MAX]  # type: ignore[union-attr]
    assert decoder._last == 1  # the normalizing map path
