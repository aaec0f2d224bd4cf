"""KvCache: chained hashes, prefix reuse, pinning, LRU eviction, events and ground truth (pure)."""

from __future__ import annotations

import hashlib
import json
import struct
import subprocess
import sys
from collections.abc import Sequence

import pytest

from sidecar.mock.kvcache import (
    ClearedRecord,
    KvCache,
    KvCacheFull,
    KvEventRecord,
    KvGroundTruth,
    MediaSpan,
    RemovedRecord,
    StoredRecord,
    block_hash,
    compute_block_hashes,
    event_from_json,
    event_to_json,
    load_ground_truth,
)

BS = 4


class RecordingSink:
    def __init__(self) -> None:
        self.batches: list[tuple[int, list[KvEventRecord]]] = []

    def publish(self, dp_rank: int, events: Sequence[KvEventRecord]) -> int:
        self.batches.append((dp_rank, list(events)))
        return len(self.batches) - 1

    def events(self) -> list[KvEventRecord]:
        return [e for _, b in self.batches for e in b]


def reference_hash(parent: int | None, tokens: Sequence[int], lora_id: int | None = None, extra=()) -> int:
    """The documented hash, written out independently of the module."""
    h = hashlib.blake2b(digest_size=8, person=b"oe-mock-kv-v1")
    h.update(b"R" if parent is None else b"P" + parent.to_bytes(8, "big"))
    h.update(b"T" + struct.pack(">I", len(tokens)) + b"".join(struct.pack(">I", t) for t in tokens))
    if lora_id:
        h.update(b"L" + struct.pack(">q", lora_id))
    for key in extra:
        raw = key.encode()
        h.update(b"X" + struct.pack(">I", len(raw)) + raw)
    return int.from_bytes(h.digest(), "big")


def test_hash_matches_documented_function_and_chains() -> None:
    toks = list(range(10))
    hashes = compute_block_hashes(toks, BS)
    assert len(hashes) == 2  # the partial tail is not hashed
    h0 = reference_hash(None, toks[:4])
    assert hashes == [h0, reference_hash(h0, toks[4:8])]
    assert block_hash(None, toks[:4]) == h0
    # chaining: same block content under another parent differs
    assert block_hash(123, toks[4:8]) != hashes[1]
    # lora and extra keys change the hash
    assert compute_block_hashes(toks, BS, lora_id=7)[0] == reference_hash(None, toks[:4], 7)
    assert compute_block_hashes(toks, BS, lora_id=7)[0] != h0
    assert compute_block_hashes(toks, BS, cache_salt="s")[0] == reference_hash(
        None, toks[:4], extra=["salt:s"]
    )
    # a media span only enters the blocks it overlaps; the chain carries it on
    spanned = compute_block_hashes(toks, BS, media_hashes=[MediaSpan("img", 5, 2)])
    assert spanned[0] == h0 and spanned[1] == reference_hash(h0, toks[4:8], extra=["img"])


def test_hash_is_deterministic_across_processes_and_uses_full_unsigned_range() -> None:
    code = "from sidecar.mock.kvcache import compute_block_hashes as c; print(c(list(range(64)), 4))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=None)
    assert json.loads(out.stdout) == compute_block_hashes(list(range(64)), 4)
    hashes = compute_block_hashes(list(range(4000)), 4)
    assert all(0 <= h < 2**64 for h in hashes)
    assert any(h >= 2**63 for h in hashes) and any(h < 2**63 for h in hashes)


def test_prefix_reuse_counts_cached_tokens_and_emits_only_new_blocks() -> None:
    sink = RecordingSink()
    cache = KvCache(0, BS, 100, sink)
    prompt = list(range(10))  # 2 full blocks + tail of 2
    a = cache.allocate(prompt)
    assert a.cached_tokens == 0 and a.num_blocks == 3 and len(a.block_hashes) == 2
    assert cache.used_blocks == 3 and cache.cached_blocks == 2
    [(rank, [stored])] = sink.batches
    assert rank == 0 and isinstance(stored, StoredRecord)
    assert stored.block_hashes == tuple(a.block_hashes) and stored.parent_block_hash is None
    assert stored.token_ids == tuple(range(8)) and stored.block_size == BS

    b = cache.allocate([*range(8), 50, 51, 52, 53, 54])  # shares two blocks, adds one
    assert b.cached_tokens == 8
    assert b.block_hashes[:2] == a.block_hashes
    new = sink.batches[-1][1]
    assert len(new) == 1 and new[0].block_hashes == (b.block_hashes[2],)  # type: ignore[union-attr]
    assert new[0].parent_block_hash == a.block_hashes[1]  # type: ignore[union-attr]
    # a fully cached prompt still recomputes its last token (vLLM's rule)
    c = cache.allocate(list(range(8)))
    assert c.cached_tokens == 4 and len(sink.batches) == 2  # nothing new stored
    assert cache.lookup(list(range(9))) == 8
    assert cache.allocate(list(range(9)), bypass_prefix_cache=True).cached_tokens == 0


def test_lru_eviction_of_unpinned_blocks_tail_first() -> None:
    sink = RecordingSink()
    cache = KvCache(0, BS, 4, sink)
    a = cache.allocate(list(range(8)))  # 2 blocks
    b = cache.allocate(list(range(100, 108)))  # 2 blocks: cache full
    with pytest.raises(KvCacheFull):
        cache.allocate(list(range(200, 204)))  # everything pinned
    assert len(sink.batches) == 2  # a refused allocation changes nothing
    cache.release(a)
    cache.release(a)  # idempotent
    c = cache.allocate(list(range(200, 204)))  # evicts a's tail block first
    removed, stored = sink.batches[-1][1]
    assert removed == RemovedRecord((a.block_hashes[1],))
    assert isinstance(stored, StoredRecord) and stored.block_hashes == tuple(c.block_hashes)
    assert cache.contains(a.block_hashes[0]) and not cache.contains(a.block_hashes[1])
    # reuse refreshes recency: a's head is pinned again, so b's blocks go next
    cache.release(b)
    d = cache.allocate([0, 1, 2, 3, 9, 9, 9, 9, 9])  # needs a new block + a tail block
    assert d.cached_tokens == 4
    removed2 = sink.batches[-1][1][0]
    assert removed2 == RemovedRecord((b.block_hashes[1], b.block_hashes[0]))
    assert cache.used_blocks == 4


def test_extend_seals_blocks_and_release_unpins() -> None:
    sink = RecordingSink()
    cache = KvCache(1, BS, 10, sink)
    a = cache.allocate([1, 2, 3, 4, 5], lora_id=3, lora_name="ad")
    assert cache.used_blocks == 2
    cache.extend(a, [6, 7, 8, 9])
    assert a.num_tokens == 9 and len(a.block_hashes) == 2 and a.tail_tokens == 1
    assert a.block_hashes == compute_block_hashes(list(range(1, 10)), BS, lora_id=3)
    sealed = sink.batches[-1][1]
    assert [type(e) for e in sealed] == [StoredRecord]
    assert sealed[0].lora_id == 3 and sealed[0].lora_name == "ad"  # type: ignore[union-attr]
    assert sealed[0].parent_block_hash == a.block_hashes[0]  # type: ignore[union-attr]
    assert cache.used_blocks == 3
    cache.release(a)
    assert cache.used_blocks == 0 and cache.cached_blocks == 2 and cache.free_blocks == 8
    with pytest.raises(ValueError):
        cache.extend(a, [1])


def test_clear_batches_and_snapshot() -> None:
    sink = RecordingSink()
    cache = KvCache(0, BS, 10, sink)
    with cache.batch():
        a = cache.allocate(list(range(8)), media_hashes=["m1"], cache_salt="salt", request_id="r1")
        b = cache.allocate([0, 1, 2, 3, 7, 7, 7, 7])
        c = cache.allocate([0, 1, 2, 3, 7, 7, 7, 7])  # shares b's blocks
    assert len(sink.batches) == 1 and len(sink.batches[0][1]) == 2
    first = sink.batches[0][1][0]
    assert isinstance(first, StoredRecord)
    assert first.extra_keys == (("m1", "salt:salt"), None) and first.cache_salt == "salt"
    snap = cache.snapshot_events()
    assert {e.block_hashes[0] for e in snap} == set(cache.cached_hashes())
    depth_ok = {None}
    for e in snap:  # parents before children
        assert e.parent_block_hash in depth_ok or e.parent_block_hash in cache.cached_hashes()
        depth_ok.add(e.block_hashes[0])
        assert len(e.token_ids) == BS
    cache.clear()
    assert sink.batches[-1][1] == [ClearedRecord()]
    assert cache.cached_blocks == 0 and cache.used_blocks == 4  # live requests keep their blocks
    assert cache.lookup([0, 1, 2, 3, 7, 7, 7, 7, 1]) == 0  # but nothing is cached
    cache.release(a)
    cache.release(b)
    assert cache.used_blocks == 2  # shared with c
    cache.release(c)
    assert cache.used_blocks == 0 and cache.free_blocks == 10


def test_ground_truth_log_and_json_round_trip(tmp_path) -> None:
    path = tmp_path / "kv.jsonl"
    gt = KvGroundTruth(path)
    sink = RecordingSink()
    caches = [KvCache(r, BS, 3, sink, ground_truth=gt) for r in (0, 1)]
    a = caches[0].allocate(list(range(8)))
    caches[0].release(a)
    caches[0].allocate(list(range(50, 58)), lora_id=2**40)
    caches[1].allocate(list(range(4)))
    caches[1].clear()
    gt.close()
    assert gt.events(0) == [e for r, b in sink.batches if r == 0 for e in b]
    assert [seq for seq, _ in gt.batches(0)] == [0, 1]  # the sink's sequence numbers
    on_disk = load_ground_truth(path)
    assert [event_from_json(e) for e in on_disk[0]] == gt.events(0)
    assert [e["type"] for e in on_disk[1]] == ["BlockStored", "AllBlocksCleared"]
    big = StoredRecord((2**64 - 1,), 2**63, (1, 2, 3, 4), 4, lora_id=5, lora_name="x", extra_keys=(("a",),))
    assert event_from_json(json.loads(json.dumps(event_to_json(big)))) == big
