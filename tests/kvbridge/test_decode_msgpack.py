"""ZMQ msgpack payloads: the decoded view (validation), and the payload the bridge publishes for
them — the engine's own, only its rank slot set (checked by the independent decoder)."""

from __future__ import annotations

import random

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from msgspec import UNSET

from sidecar.kvbridge.decode_msgpack import MsgpackBatchDecoder, decode_msgpack_batch
from sidecar.kvbridge.errors import KvDecodeError
from sidecar.kvbridge.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    cleared_payload,
    decode_output_batch,
    encode_batch,
    heartbeat_payload,
    published_payload,
    with_rank,
)
from tests.kvbridge import gen
from tests.kvbridge.consumer import decode_payload
from tests.kvbridge.fake_zmq_engine import encode_wire

STYLES = ["vllm-map", "vllm-array", "sglang", "sglang-array"]
U64_MAX = (1 << 64) - 1


def published(payload: bytes, rank: int = 0) -> bytes:
    """What the bridge publishes for ``payload`` on ``rank`` (validated first, as the ingest does)."""
    return published_payload(payload, decode_msgpack_batch(payload).data_parallel_rank, rank)


def roundtrip(payload: bytes, rank: int = 0) -> tuple[float, list[dict], int | None]:
    """Publish as the bridge does, decode independently."""
    return decode_payload(published(payload, rank))


#: (style, hash kind) pairs an engine can send: SGLang hashes are always ints.
STYLE_HASHES = [
    (s, h) for s in STYLES for h in ("int", "bytes") if not (h == "bytes" and s.startswith("sglang"))
]


@pytest.mark.parametrize(("style", "hash_kind"), STYLE_HASHES)
@pytest.mark.parametrize("negative", [False, True])
def test_every_style_passes_through_exactly(style: str, hash_kind: str, negative: bool) -> None:
    rng = random.Random(f"{style}{hash_kind}{negative}")
    decoder = MsgpackBatchDecoder()
    for _ in range(30):
        events = gen.batch(rng, rng.randint(0, 20), hash_kind=hash_kind, style=style)
        payload = encode_wire(events, style, rank=3, ts=12.5, negative=negative)
        batch = decoder.decode(payload)
        assert batch.ts == 12.5 and len(batch.events) == len(events)
        assert batch.data_parallel_rank == (None if style == "sglang-array" else 3)
        out = published_payload(payload, batch.data_parallel_rank, 3)
        if style == "sglang-array":  # [ts, events]: the rank slot added, nothing else
            assert msgspec.msgpack.decode(out) == [*msgspec.msgpack.decode(payload), 3]
        else:
            assert out is payload
        ts, sent, rank = decode_payload(out)
        assert (ts, rank) == (12.5, 3) and sent == msgspec.msgpack.decode(payload)[1]
        if events:
            assert decoder.form == ("array" if style.endswith("array") else "map")


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
    assert published(payload) is payload and roundtrip(payload)[1] == [ev]


def test_fields_the_bridge_does_not_know_pass_through() -> None:
    """vLLM 0.32's locality / ownership / session_id, SGLang 0.5.23's cache_salt / session_id,
    and a field no engine has yet: in the published payload as the engine wrote them."""
    vllm = {
        "type": "BlockStored",
        "block_hashes": [1 << 63],
        "parent_block_hash": None,
        "token_ids": [1, 2],
        "block_size": 2,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "locality": "LOCAL",
        "ownership": "tier-2",
        "session_id": "agent-7",
    }
    removed = {"type": "BlockRemoved", "block_hashes": [1 << 63], "medium": "GPU", "locality": "REMOTE"}
    sglang = {
        "type": "BlockStored",
        "block_hashes": [-4611686018427387911],
        "parent_block_hash": -1,
        "token_ids": [3],
        "block_size": 1,
        "lora_id": None,
        "medium": "CPU_PINNED",
        "cache_salt": "salt",
        "session_id": "s1",
        "future": {"nested": [1, {"x": b"\x00"}]},
    }
    for events, rank in (([vllm, removed], 0), ([sglang], 4)):
        payload = msgspec.msgpack.encode([7.5, events, rank])
        assert published(payload, rank) is payload
        assert roundtrip(payload, rank) == (7.5, events, rank)
        # relabelled for another rank: still only the rank slot changes
        assert roundtrip(payload, rank + 1) == (7.5, events, rank + 1)


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


@pytest.mark.parametrize("form", ["array", "map"])
def test_signed_int64_hashes_stay_signed(form: str) -> None:
    hashes, parent = [-1, -(1 << 63), -4611686018427387911], -2
    if form == "array":
        events: list[object] = [
            ["BlockStored", hashes, parent, [1, 2, 3], 1, None, "GPU", None],
            ["BlockRemoved", hashes],
        ]
    else:
        stored_map = {
            "type": "BlockStored",
            "block_hashes": hashes,
            "parent_block_hash": parent,
            "token_ids": [1],
        }
        events = [stored_map, {"type": "BlockRemoved", "block_hashes": hashes}]
    payload = msgspec.msgpack.encode([0.0, events, 0])
    stored, removed = decode_msgpack_batch(payload).events
    assert isinstance(stored, BlockStored) and isinstance(removed, BlockRemoved)
    assert stored.block_hashes == hashes == removed.block_hashes and stored.parent_block_hash == parent
    assert published(payload) is payload
    assert roundtrip(payload)[1] == events  # -4611686018427387911 stays, not 13835058055282163705


def test_decoder_adapts_to_the_source_shape_and_back() -> None:
    decoder = MsgpackBatchDecoder()
    assert decoder.form is None
    m = msgspec.msgpack.encode([0.0, [{"type": "AllBlocksCleared"}], 0])
    a = msgspec.msgpack.encode([0.0, [["AllBlocksCleared"]], 0])
    empty = msgspec.msgpack.encode([0.0, [], 0])
    for p, form in ((a, "array"), (a, "array"), (m, "map"), (a, "array"), (m, "map"), (empty, "map")):
        assert decoder.decode(p).events == ([AllBlocksCleared()] if p != empty else [])
        assert decoder.form == form  # an empty batch leaves the form as it was


def test_payloads_the_bridge_writes_itself() -> None:
    """AllBlocksCleared in the source's form; the heartbeat: no events."""
    for form, ev in (("map", {"type": "AllBlocksCleared"}), ("array", ["AllBlocksCleared"])):
        assert decode_payload(cleared_payload(2.5, 3, form)) == (2.5, [ev], 3)  # type: ignore[arg-type]
    assert decode_payload(heartbeat_payload(9.0, 1)) == (9.0, [], 1)
    decoded = decode_msgpack_batch(heartbeat_payload(9.0, 1))
    assert decoded.events == [] and decoded.data_parallel_rank == 1


def test_rank_slot_is_the_only_change() -> None:
    ev = {"type": "AllBlocksCleared"}
    two = msgspec.msgpack.encode([1.0, [ev]])  # no rank slot (older engines)
    none = msgspec.msgpack.encode([1.0, [ev], None])  # vLLM without omit_defaults
    other = msgspec.msgpack.encode([1.0, [ev], 5, "future"])  # another rank, a trailing field
    as_map = msgspec.msgpack.encode({"ts": 1.0, "events": [ev], "attn_dp_rank": 2})
    assert msgspec.msgpack.decode(published(two, 2)) == [1.0, [ev], 2]
    assert msgspec.msgpack.decode(published(none, 2)) == [1.0, [ev], 2]
    assert msgspec.msgpack.decode(published(other, 2)) == [1.0, [ev], 2, "future"]
    assert msgspec.msgpack.decode(published(as_map, 2)) == [1.0, [ev], 2]  # a map-shaped batch: an array
    same = msgspec.msgpack.encode([1.0, [ev], 2, "future"])
    assert published(same, 2) is same
    big = msgspec.msgpack.encode([1.0, [ev] * 20, 2])  # array 16 events list: the batch itself a fixarray
    assert published(big, 2) is big
    assert with_rank(msgspec.msgpack.encode([1, [], 0]), 70000) == msgspec.msgpack.encode([1, [], 70000])


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
def test_property_published_payload_is_the_engines(events: list[dict], style: str, ts: float) -> None:
    payload = encode_wire(events, style, rank=1, ts=ts)
    assert published(payload, 1) is payload
    assert roundtrip(payload, 1) == (ts, msgspec.msgpack.decode(payload)[1], 1)


def test_view_of_optional_fields_placeholders_and_explicit_nones() -> None:
    arr = ["BlockStored", [1], None, [1], 1, None, "GPU", None, None, 3]  # extra_keys slot is a placeholder
    mp = {"type": "BlockStored", "block_hashes": [2], "extra_keys": None, "group_idx": None}
    rm = ["BlockRemoved", [3], None, None]
    payload = msgspec.msgpack.encode([0.0, [arr, mp, rm], 0])
    a, b, c = decode_msgpack_batch(payload).events
    assert isinstance(a, BlockStored) and isinstance(b, BlockStored) and isinstance(c, BlockRemoved)
    assert a.extra_keys is UNSET and a.group_idx == 3
    assert b.extra_keys is None and b.group_idx is None  # an engine's explicit None is kept
    assert c.group_idx is UNSET
    assert roundtrip(payload)[1] == [arr, mp, rm]  # published as written, placeholders included


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
    neg = {**ev, "block_hashes": [-1], "cache_salt": "s"}  # SGLang 0.5.23: signed hashes, its own fields
    assert decoder.decode(msgspec.msgpack.encode([0.0, [neg], 0])).events[0].block_hashes == [-1]  # type: ignore[union-attr]
    assert decoder._last == 0  # still the fast path
    meta = {**ev, "lora_name": {"cache_salt": "s"}}  # older SGLang's metadata map
    assert decoder.decode(msgspec.msgpack.encode([0.0, [meta], 0])).events[0].metadata == {"cache_salt": "s"}  # type: ignore[union-attr]
    assert decoder._last == 1
