"""pb.KvEventBatch -> the bridge's model (vLLM's map form): the field mapping of the one re-encoded source."""

from __future__ import annotations

import pytest

from sidecar.kvbridge.decode_proto import batch_from_proto, block_hash_from_proto, event_from_proto
from sidecar.kvbridge.errors import KvDecodeError
from sidecar.kvbridge.events import CLEARED, BlockRemoved, BlockStored, encode_batch
from sidecar.openengine import pb
from tests.kvbridge.consumer import decode_payload

U64_MAX = (1 << 64) - 1


def h(value: bytes, encoding: str) -> pb.KvBlockHash:
    return pb.KvBlockHash(value=value, encoding=encoding)


@pytest.mark.parametrize(
    ("value", "encoding", "expected"),
    [
        (U64_MAX.to_bytes(8, "big"), "int64", U64_MAX),
        ((1 << 63).to_bytes(8, "big"), "uint64", 1 << 63),
        ((5).to_bytes(8, "big"), "INT64", 5),
        (b"\x01\x00", "u64", 256),
        (b"-1", "decimal_int64", -1),  # decimal: as written, sign kept
        (b"-4611686018427387911", "decimal", -4611686018427387911),
        (b"-9223372036854775808", "decimal_int64", -(1 << 63)),
        (b"18446744073709551615", "decimal", U64_MAX),
        (b"42", "string", 42),
        (b"9f86d081", "string", b"9f86d081"),
        (b"\x00\x01\x02", "bytes", b"\x00\x01\x02"),
        (b"\xab" * 32, "sha256", b"\xab" * 32),
        (b"\xab\xcd", "hex", b"\xab\xcd"),
        (b"\x01" * 8, "", b"\x01" * 8),
        (b"\x01" * 8, "engine_specific", b"\x01" * 8),
    ],
)
def test_block_hash_encodings(value: bytes, encoding: str, expected: int | bytes) -> None:
    assert block_hash_from_proto(h(value, encoding)) == expected


@pytest.mark.parametrize(
    ("value", "encoding"),
    [
        (b"\x01" * 9, "int64"),
        (b"", "int64"),
        (b"12a", "decimal"),
        (b"\xff\xfe", "decimal"),
        (b"99999999999999999999999", "decimal"),
        (b"-9223372036854775809", "decimal_int64"),
    ],
)
def test_bad_block_hashes(value: bytes, encoding: str) -> None:
    with pytest.raises(KvDecodeError):
        block_hash_from_proto(h(value, encoding))


def test_block_stored_every_field() -> None:
    ev = pb.KvEvent(
        request_id="r1",
        block_stored=pb.BlockStored(
            block_hashes=[h(U64_MAX.to_bytes(8, "big"), "int64"), h((7).to_bytes(8, "big"), "int64")],
            parent_block_hash=h((3).to_bytes(8, "big"), "int64"),
            token_ids=[1, 2, 3, 4],
            block_size=2,
            lora_id=5,
            lora_name="ad",
            medium=pb.StorageMedium.CPU_PINNED,
            extra_keys=[pb.OpaqueKeyTuple(values=["mm:1", "x"]), pb.OpaqueKeyTuple()],
            group_idx=1,
            kv_cache_spec_kind="sliding_window",
            kv_cache_spec_sliding_window=64,
        ),
    )
    assert event_from_proto(pb.KvEvent.parse(bytes(ev))) == BlockStored(
        [U64_MAX, 7],
        3,
        [1, 2, 3, 4],
        2,
        5,
        "CPU_PINNED",
        "ad",
        [["mm:1", "x"], None],
        1,
        "sliding_window",
        64,
    )


def test_defaults_become_none_and_are_omitted() -> None:
    ev = pb.KvEvent(
        block_stored=pb.BlockStored(block_hashes=[h(b"\x01", "int64")], token_ids=[9], block_size=1)
    )
    out = event_from_proto(pb.KvEvent.parse(bytes(ev)))
    assert out == BlockStored([1], None, [9], 1, None, None, None)
    empty_parent = pb.KvEvent(
        block_stored=pb.BlockStored(block_hashes=[h(b"\x01", "int64")], parent_block_hash=pb.KvBlockHash())
    )
    assert event_from_proto(empty_parent).parent_block_hash is None  # type: ignore[union-attr]
    rm = pb.KvEvent(
        block_removed=pb.BlockRemoved(block_hashes=[h(b"ab", "bytes")], medium=pb.StorageMedium.GPU)
    )
    assert event_from_proto(rm) == BlockRemoved([b"ab"], "GPU")
    assert event_from_proto(pb.KvEvent(all_blocks_cleared=pb.AllBlocksCleared())) is CLEARED


def test_unknown_medium_and_empty_event() -> None:
    # medium = 99 (field 2, varint): an enum value from a newer schema reads as unspecified
    weird = pb.BlockRemoved.parse(bytes(pb.BlockRemoved(block_hashes=[h(b"\x02", "int64")])) + b"\x10\x63")
    assert event_from_proto(pb.KvEvent(block_removed=weird)) == BlockRemoved([2], None)
    with pytest.raises(KvDecodeError):
        event_from_proto(pb.KvEvent(request_id="x"))
    with pytest.raises(KvDecodeError):
        event_from_proto(pb.KvEvent(block_removed=pb.BlockRemoved(block_hashes=[pb.KvBlockHash()])))


def test_batch_to_output() -> None:
    batch = pb.KvEventBatch(
        sequence_number=9,
        timestamp_unix_nanos=1_700_000_000_500_000_000,
        data_parallel_rank=2,
        events=[
            pb.KvEvent(all_blocks_cleared=pb.AllBlocksCleared()),
            pb.KvEvent(block_removed=pb.BlockRemoved(block_hashes=[h(b"\xff" * 8, "int64")])),
        ],
    )
    out = batch_from_proto(batch)
    assert out.data_parallel_rank == 2
    assert out.ts == pytest.approx(1_700_000_000.5)
    _ts, events, rank = decode_payload(encode_batch(out))
    assert rank == 2
    assert events == [
        {"type": "AllBlocksCleared"},
        {"type": "BlockRemoved", "block_hashes": [U64_MAX], "medium": None},
    ]
