"""SGLang's own KV event classes on both sides of the bridge: ``sglang.srt.disaggregation.kv_events.ZmqEventPublisher``
feeds it, ``msgspec.msgpack.Decoder(KVEventBatch)`` (SGLang's) reads what it publishes — live,
after idling past the heartbeat, and from its replay. SGLang's signed int64 block hashes arrive
signed, its ``cache_salt``, ``session_id``, ``lora_name`` and medium names as it wrote them,
each event once. No engine process and no GPU: the classes only (the module imports with torch).
"""

from __future__ import annotations

from tests.kvbridge.engine_publisher import engine_classes_through_bridge
from tests.prereq import require_module

kv_events = require_module("sglang.srt.disaggregation.kv_events", "scripts/install-sglang")
AllBlocksCleared = kv_events.AllBlocksCleared
BlockRemoved = kv_events.BlockRemoved
BlockStored = kv_events.BlockStored
KVEventBatch = kv_events.KVEventBatch

SIGNED = -4611686018427387911  # once republished as 13835058055282163705


def every_field() -> list[list[object]]:
    salted = BlockStored(
        block_hashes=[SIGNED, (1 << 63) - 1, -1],
        parent_block_hash=-(1 << 63),
        token_ids=list(range(6)),
        block_size=2,
        lora_id=4,
        medium="CPU_PINNED",
        cache_salt="salt-1",
        session_id="session-9",
        lora_name="adapter-4",
    )
    plain = BlockStored(
        block_hashes=[5], parent_block_hash=None, token_ids=[1, 2], block_size=2, lora_id=None
    )
    on_disk = BlockStored(
        block_hashes=[SIGNED - 1], parent_block_hash=SIGNED, token_ids=[3, 4], block_size=2, lora_id=None,
        medium="DISK", session_id="session-9",
    )  # fmt: skip
    removed = [BlockRemoved(block_hashes=[SIGNED], medium="EXTERNAL"), BlockRemoved(block_hashes=[-1])]
    return [[salted, plain], removed, [AllBlocksCleared(), on_disk], [plain, *removed]]


async def test_sglang_publisher_to_sglang_decoder_through_the_bridge() -> None:
    batches = every_field()
    applied = await engine_classes_through_bridge(kv_events, batches, attn_dp_rank=0)
    assert applied == [e for b in batches for e in b]  # exactly as SGLang made them
    first = applied[0]
    assert first.block_hashes[0] == SIGNED and first.parent_block_hash == -(1 << 63)
    assert (first.cache_salt, first.session_id, first.lora_name) == ("salt-1", "session-9", "adapter-4")
    assert [e.medium for e in applied if isinstance(e, BlockRemoved)] == ["EXTERNAL", None, "EXTERNAL", None]
