"""vLLM's own KV event classes on both sides of the bridge: ``vllm.distributed.kv_events.ZmqEventPublisher``
feeds it, ``msgspec.msgpack.Decoder(KVEventBatch)`` reads what it publishes — live, after idling
past the heartbeat, and from its replay. Every field of vLLM's events arrives as vLLM wrote it
(``locality``, ``ownership``, ``session_id`` included; hashes over 2**63 and bytes hashes), each
event once. Also: a ``SubscribeKvEvents`` batch the bridge re-encodes decodes with vLLM's classes,
every field the two formats share mapped (docs/KVBRIDGE.md). No engine process: the classes only.
"""

from __future__ import annotations

import msgspec
import pytest

from sidecar.kvbridge.decode_proto import batch_from_proto
from sidecar.kvbridge.events import encode_batch
from sidecar.openengine import pb
from tests.kvbridge.engine_publisher import engine_classes_through_bridge
from tests.prereq import require_module

kv_events = require_module("vllm.distributed.kv_events", "scripts/install-vllm")
AllBlocksCleared = kv_events.AllBlocksCleared
BlockRemoved = kv_events.BlockRemoved
BlockStored = kv_events.BlockStored
KVEventBatch = kv_events.KVEventBatch

U64_MAX = (1 << 64) - 1


def every_field() -> list[list[object]]:
    full = BlockStored(
        block_hashes=[U64_MAX, (1 << 63) + 5, b"\x01" * 32],
        parent_block_hash=1 << 63,
        token_ids=list(range(12)),
        block_size=4,
        lora_id=3,
        medium="CPU",
        lora_name="adapter-3",
        extra_keys=[("adapter-3", ("mm-hash", 0)), None, ("adapter-3", "salt")],
        group_idx=2,
        kv_cache_spec_kind="sliding_window",
        kv_cache_spec_sliding_window=4096,
        locality="REMOTE",
        ownership="tier-2",
        session_id="agent-7",
    )
    bytes_parent = BlockStored(
        block_hashes=[b"\x02" * 32],
        parent_block_hash=b"\x01" * 32,
        token_ids=[7, 8, 9, 10],
        block_size=4,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        session_id="agent-8",
    )
    removed = BlockRemoved(
        block_hashes=[U64_MAX, b"\x01" * 32], medium="GPU", group_idx=1, locality="LOCAL", ownership="tier-1"
    )
    plain = BlockStored(
        block_hashes=[11], parent_block_hash=None, token_ids=[1, 2, 3, 4], block_size=4, lora_id=None,
        medium=None, lora_name=None,
    )  # fmt: skip
    return [[full, bytes_parent], [removed], [AllBlocksCleared(), plain], [plain, removed, bytes_parent]]


async def test_vllm_publisher_to_vllm_decoder_through_the_bridge() -> None:
    batches = every_field()
    applied = await engine_classes_through_bridge(kv_events, batches, data_parallel_rank=0)
    first = applied[0]
    assert (first.locality, first.ownership, first.session_id) == ("REMOTE", "tier-2", "agent-7")
    assert first.block_hashes == [U64_MAX, (1 << 63) + 5, b"\x01" * 32] and first.parent_block_hash == 1 << 63
    # vLLM's decoder reads a nested extra key back as a list (extra_keys is list[tuple[Any, ...]])
    assert first.extra_keys == [("adapter-3", ["mm-hash", 0]), None, ("adapter-3", "salt")]
    assert applied[1:] == [e for b in batches for e in b][1:]  # every other event exactly as vLLM made it


def test_a_subscribe_kv_events_batch_decodes_with_vllms_classes() -> None:
    """The gRPC source's mapping: every field kv.proto and vLLM's events share, as vLLM's decoder reads it."""
    h = pb.KvBlockHash
    batch = pb.KvEventBatch(
        sequence_number=4,
        timestamp_unix_nanos=1_700_000_000_250_000_000,
        data_parallel_rank=0,
        events=[
            pb.KvEvent(
                request_id="r1",
                block_stored=pb.BlockStored(
                    block_hashes=[h(value=U64_MAX.to_bytes(8, "big"), encoding="int64"), h(value=b"\x05" * 32, encoding="bytes")],
                    parent_block_hash=h(value=b"-3", encoding="decimal_int64"),
                    token_ids=[1, 2, 3, 4],
                    block_size=2,
                    lora_id=9,
                    lora_name="ad",
                    medium=pb.StorageMedium.GPU,
                    extra_keys=[pb.OpaqueKeyTuple(values=["mm:1", "0"]), pb.OpaqueKeyTuple()],
                    group_idx=1,
                    kv_cache_spec_kind="sliding_window",
                    kv_cache_spec_sliding_window=64,
                ),
            ),
            pb.KvEvent(block_removed=pb.BlockRemoved(block_hashes=[h(value=b"\x07", encoding="uint64")], medium=pb.StorageMedium.EXTERNAL, group_idx=3)),
            pb.KvEvent(all_blocks_cleared=pb.AllBlocksCleared()),
        ],
    )  # fmt: skip
    out = msgspec.msgpack.Decoder(KVEventBatch).decode(encode_batch(batch_from_proto(batch)))
    assert out.ts == pytest.approx(1_700_000_000.25) and out.data_parallel_rank == 0
    assert out.events == [
        BlockStored(
            block_hashes=[U64_MAX, b"\x05" * 32],
            parent_block_hash=-3,
            token_ids=[1, 2, 3, 4],
            block_size=2,
            lora_id=9,
            medium="GPU",
            lora_name="ad",
            extra_keys=[("mm:1", "0"), None],
            group_idx=1,
            kv_cache_spec_kind="sliding_window",
            kv_cache_spec_sliding_window=64,
        ),
        BlockRemoved(block_hashes=[7], medium="EXTERNAL", group_idx=3),
        AllBlocksCleared(),
    ]
