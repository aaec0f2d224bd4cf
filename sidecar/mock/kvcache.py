"""Paged KV cache of a simulated engine: chained block hashes, prefix reuse, pinning, LRU eviction.

I/O-free. One :class:`KvCache` per data-parallel rank. Every change of the cache's
contents is reported, in order, as KV events (:class:`StoredRecord`,
:class:`RemovedRecord`, :class:`ClearedRecord`) to a :class:`KvEventSink` (the
ZMQ publishers of ``sidecar.mock.kvevents`` or the gRPC source of
``sidecar.mock.kvevents_grpc``) and to an optional :class:`KvGroundTruth` log that
tests compare the sidecar's KV bridge against.

Integration (for the engine): one ``KvCache(rank, block_size, total_blocks, sink,
ground_truth=gt)`` per DP rank; ``alloc = cache.allocate(prompt_ids, lora_id=...,
lora_name=..., media_hashes=..., cache_salt=...)`` when a request is scheduled
(``alloc.cached_tokens`` is ``Usage.cached_prompt_tokens``; :class:`KvCacheFull`
means "no room now": queue or reject as OVERLOADED); ``cache.extend(alloc,
new_ids)`` as tokens are generated (optional); ``cache.release(alloc)`` when the
request ends (idempotent). Events of one call form one batch; wrap several calls
in ``with cache.batch():`` to publish them as one batch (one engine "step").
Call from the event-loop thread only (the ZMQ sink sends from inside ``publish``).

Block hash (a documented contract: deterministic across processes, no
``PYTHONHASHSEED``; the full unsigned 64-bit range, so about half the hashes
exceed ``2**63 - 1``)::

    h = hashlib.blake2b(digest_size=8, person=b"oe-mock-kv-v1")
    h.update(b"R")                                   # root block (no parent), or
    h.update(b"P" + parent.to_bytes(8, "big"))       # chained to the parent block's hash
    h.update(b"T" + struct.pack(">I", n) + struct.pack(f">{n}I", *token_ids))
    h.update(b"L" + struct.pack(">q", lora_id))      # only when lora_id is a non-zero int
    for key in extra_keys:                           # media hashes, then "salt:<cache_salt>"
        raw = key.encode(); h.update(b"X" + struct.pack(">I", len(raw)) + raw)
    block_hash = int.from_bytes(h.digest(), "big")   # unsigned 64-bit

Extra keys of a block (also reported per block in ``BlockStored.extra_keys``): the
hashes of the media items whose placeholder tokens overlap the block (a bare
string in ``media_hashes`` belongs to block 0), then ``"salt:<cache_salt>"`` on
block 0 only. The chain carries them into every later block.

Capacity: only full blocks are hashed and cached (as in vLLM); a request's partly
filled tail block is private and uncached. ``used_blocks`` counts blocks in use by
requests (pinned cached blocks + private blocks), ``cached_blocks`` all cached
blocks (including unpinned ones kept for reuse), and a new block is taken from
free space first, then by evicting the least recently used unpinned block
(a released request's tail blocks become evictable before its head blocks).
``cached_tokens`` follows vLLM: the leading cached full blocks, capped so that at
least the last prompt token is recomputed.
"""

from __future__ import annotations

import hashlib
import logging
import struct
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from sidecar.mock.kvevents_model import (
    MEDIUM_GPU,
    ClearedRecord,
    KvEventRecord,
    KvEventSink,
    KvGroundTruth,
    RemovedRecord,
    StoredRecord,
    event_from_json,
    event_to_json,
    load_ground_truth,
)

__all__ = [
    "Allocation",
    "ClearedRecord",
    "KvCache",
    "KvCacheFull",
    "KvEventRecord",
    "KvEventSink",
    "KvGroundTruth",
    "MediaSpan",
    "RemovedRecord",
    "StoredRecord",
    "block_extra_keys",
    "block_hash",
    "compute_block_hashes",
    "event_from_json",
    "event_to_json",
    "load_ground_truth",
]

logger = logging.getLogger(__name__)

_PERSON = b"oe-mock-kv-v1"


# --------------------------------------------------------------------------- hashing


@dataclass(frozen=True, slots=True)
class MediaSpan:
    """A media item's hash and the prompt positions of its placeholder tokens."""

    hash: str
    offset: int
    length: int


def block_hash(
    parent: int | None,
    token_ids: Sequence[int],
    *,
    lora_id: int | None = None,
    extra_keys: Sequence[str] = (),
) -> int:
    """The chained 64-bit hash of one full block (see the module docstring)."""
    h = hashlib.blake2b(digest_size=8, person=_PERSON)
    if parent is None:
        h.update(b"R")
    else:
        h.update(b"P" + parent.to_bytes(8, "big"))
    n = len(token_ids)
    h.update(b"T" + struct.pack(">I", n) + struct.pack(f">{n}I", *token_ids))
    if lora_id:
        h.update(b"L" + struct.pack(">q", lora_id))
    for key in extra_keys:
        raw = key.encode("utf-8")
        h.update(b"X" + struct.pack(">I", len(raw)) + raw)
    return int.from_bytes(h.digest(), "big")


def block_extra_keys(
    block_index: int,
    block_size: int,
    media_hashes: Sequence[str | MediaSpan] = (),
    cache_salt: str | None = None,
) -> tuple[str, ...]:
    """Extra hash inputs of block ``block_index`` (media overlapping it, then the salt on block 0)."""
    start, end = block_index * block_size, (block_index + 1) * block_size
    keys: list[str] = []
    for item in media_hashes:
        if isinstance(item, MediaSpan):
            if item.offset < end and item.offset + max(item.length, 1) > start:
                keys.append(item.hash)
        elif block_index == 0:
            keys.append(item)
    if cache_salt is not None and block_index == 0:
        keys.append(f"salt:{cache_salt}")
    return tuple(keys)


def compute_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    *,
    lora_id: int | None = None,
    media_hashes: Sequence[str | MediaSpan] = (),
    cache_salt: str | None = None,
) -> list[int]:
    """Hashes of every full block of ``token_ids`` (what a decode engine expects to receive)."""
    hashes: list[int] = []
    parent: int | None = None
    for i in range(len(token_ids) // block_size):
        extra = block_extra_keys(i, block_size, media_hashes, cache_salt)
        parent = block_hash(
            parent, token_ids[i * block_size : (i + 1) * block_size], lora_id=lora_id, extra_keys=extra
        )
        hashes.append(parent)
    return hashes


# --------------------------------------------------------------------------- cache


class KvCacheFull(Exception):
    """Not enough free or evictable blocks for the request (nothing was changed)."""

    def __init__(self, needed: int, available: int) -> None:
        super().__init__(f"KV cache full: need {needed} blocks, {available} available")
        self.needed = needed
        self.available = available


@dataclass(slots=True)
class _Block:
    parent: int | None
    refs: int
    token_ids: tuple[int, ...]
    lora_id: int | None
    lora_name: str | None
    extra_keys: tuple[str, ...]


@dataclass(eq=False)
class Allocation:
    """A request's blocks on one rank; pinned until :meth:`KvCache.release`.

    ``block_hashes`` lists the full blocks in order (what a prefill hands to
    decode); ``num_blocks`` also counts the partly filled tail block.
    """

    dp_rank: int
    block_size: int
    block_hashes: list[int]
    num_tokens: int
    cached_tokens: int
    lora_id: int | None = None
    lora_name: str | None = None
    cache_salt: str | None = None
    request_id: str | None = None
    media_hashes: tuple[str | MediaSpan, ...] = ()
    released: bool = False
    _tail: list[int] = field(default_factory=list, repr=False)
    _pinned: list[int] = field(default_factory=list, repr=False)
    _private: int = field(default=0, repr=False)
    _detached: list[int] = field(default_factory=list, repr=False)

    @property
    def num_blocks(self) -> int:
        return len(self.block_hashes) + (1 if self._tail else 0)

    @property
    def tail_tokens(self) -> int:
        return len(self._tail)


class KvCache:
    """One DP rank's paged prefix cache. Not thread-safe: call from the engine's loop thread."""

    def __init__(
        self,
        dp_rank: int,
        block_size: int,
        total_blocks: int,
        sink: KvEventSink | None = None,
        *,
        ground_truth: KvGroundTruth | None = None,
        medium: str = MEDIUM_GPU,
    ) -> None:
        if block_size <= 0 or total_blocks <= 0:
            raise ValueError("block_size and total_blocks must be positive")
        self.dp_rank = dp_rank
        self.block_size = block_size
        self.total_blocks = total_blocks
        self.medium = medium
        self._sink = sink
        self._ground_truth = ground_truth
        self._blocks: dict[int, _Block] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # refs == 0, LRU first
        self._pinned_blocks = 0
        self._private_blocks = 0
        self._detached_refs: dict[int, int] = {}  # blocks dropped by clear() but still in use
        self._live: dict[int, Allocation] = {}
        self._pending: list[KvEventRecord] = []
        self._batch_depth = 0

    # ---- counters
    @property
    def used_blocks(self) -> int:
        """Blocks in use by requests (pinned cached blocks, private tail blocks, blocks kept past clear())."""
        return self._pinned_blocks + self._private_blocks + len(self._detached_refs)

    @property
    def cached_blocks(self) -> int:
        return len(self._blocks)

    @property
    def free_blocks(self) -> int:
        """Blocks neither cached nor in use (eviction can free ``cached - pinned`` more)."""
        return self.total_blocks - len(self._blocks) - self._private_blocks - len(self._detached_refs)

    def contains(self, block_hash_: int) -> bool:
        return block_hash_ in self._blocks

    def cached_hashes(self) -> list[int]:
        return list(self._blocks)

    # ---- batching
    @contextmanager
    def batch(self) -> Iterator[None]:
        """Publish every event of the enclosed calls as one batch (one engine step). Re-entrant."""
        self._batch_depth += 1
        try:
            yield
        finally:
            self._batch_depth -= 1
            if self._batch_depth == 0:
                self._flush()

    def _emit(self, events: list[KvEventRecord]) -> None:
        self._pending.extend(events)
        if self._batch_depth == 0:
            self._flush()

    def _flush(self) -> None:
        if not self._pending:
            return
        events, self._pending = self._pending, []
        seq = self._sink.publish(self.dp_rank, events) if self._sink is not None else None
        if self._ground_truth is not None:
            self._ground_truth.record(self.dp_rank, seq, events)

    # ---- lookup
    def lookup(
        self,
        token_ids: Sequence[int],
        *,
        lora_id: int | None = None,
        media_hashes: Sequence[str | MediaSpan] = (),
        cache_salt: str | None = None,
    ) -> int:
        """Prompt tokens that :meth:`allocate` would find cached now (no change, no event)."""
        hashes = compute_block_hashes(
            token_ids, self.block_size, lora_id=lora_id, media_hashes=media_hashes, cache_salt=cache_salt
        )
        return self._cached_prefix_tokens(hashes, len(token_ids))

    def _cached_prefix_tokens(self, hashes: Sequence[int], num_tokens: int) -> int:
        limit = max(num_tokens - 1, 0) // self.block_size
        hits = 0
        for h in hashes[:limit]:
            if h not in self._blocks:
                break
            hits += 1
        return hits * self.block_size

    # ---- allocation
    def allocate(
        self,
        token_ids: Sequence[int],
        *,
        lora_id: int | None = None,
        lora_name: str | None = None,
        media_hashes: Sequence[str | MediaSpan] = (),
        cache_salt: str | None = None,
        bypass_prefix_cache: bool = False,
        request_id: str | None = None,
    ) -> Allocation:
        """Pin cached prefix blocks, store new full blocks, take a private tail block.

        Emits ``BlockRemoved`` for evictions, then one ``BlockStored`` per run of new
        blocks. ``bypass_prefix_cache`` reports ``cached_tokens = 0`` (blocks whose
        hash is already cached are still shared, not duplicated).
        Raises :class:`KvCacheFull` (cache unchanged) when the blocks do not fit.
        """
        bs = self.block_size
        n_full = len(token_ids) // bs
        extras = [block_extra_keys(i, bs, media_hashes, cache_salt) for i in range(n_full)]
        hashes: list[int] = []
        parent: int | None = None
        for i in range(n_full):
            parent = block_hash(
                parent, token_ids[i * bs : (i + 1) * bs], lora_id=lora_id, extra_keys=extras[i]
            )
            hashes.append(parent)
        cached_tokens = 0 if bypass_prefix_cache else self._cached_prefix_tokens(hashes, len(token_ids))
        tail = list(token_ids[n_full * bs :])

        new_idx = [i for i, h in enumerate(hashes) if h not in self._blocks]
        reused = {h for h in hashes if h in self._blocks}
        needed = len(new_idx) + (1 if tail else 0)
        evictable_now = len(self._evictable) - sum(1 for h in reused if h in self._evictable)
        if needed > self.free_blocks + evictable_now:
            raise KvCacheFull(needed, self.free_blocks + evictable_now)

        alloc = Allocation(
            dp_rank=self.dp_rank,
            block_size=bs,
            block_hashes=hashes,
            num_tokens=len(token_ids),
            cached_tokens=cached_tokens,
            lora_id=lora_id,
            lora_name=lora_name,
            cache_salt=cache_salt,
            request_id=request_id,
            media_hashes=tuple(media_hashes),
            _tail=tail,
        )
        for h in hashes:
            if h in reused:
                self._pin(h)
        events: list[KvEventRecord] = []
        removed = self._evict(needed - self.free_blocks)
        if removed:
            events.append(RemovedRecord(tuple(removed), self.medium))
        # one StoredRecord per contiguous run of new blocks
        run: list[int] = []
        for i in new_idx:
            if run and run[-1] != i - 1:
                events.append(self._stored(alloc, hashes, run, token_ids, extras))
                run = []
            run.append(i)
            self._blocks[hashes[i]] = _Block(
                parent=hashes[i - 1] if i else None,
                refs=1,
                token_ids=tuple(token_ids[i * bs : (i + 1) * bs]),
                lora_id=lora_id,
                lora_name=lora_name,
                extra_keys=extras[i],
            )
            self._pinned_blocks += 1
        if run:
            events.append(self._stored(alloc, hashes, run, token_ids, extras))
        alloc._pinned = list(hashes)
        if tail:
            alloc._private = 1
            self._private_blocks += 1
        self._live[id(alloc)] = alloc
        self._emit(events)
        return alloc

    def extend(self, allocation: Allocation, new_token_ids: Sequence[int]) -> None:
        """Append generated tokens; each block they fill is hashed and stored (``BlockStored``).

        Tokens are taken one at a time: on :class:`KvCacheFull` the tokens before
        the one that needed a new block stay appended, and the events so far are emitted.
        """
        if allocation.released:
            raise ValueError("allocation already released")
        bs = self.block_size
        events: list[KvEventRecord] = []
        try:
            for tok in new_token_ids:
                if not allocation._tail:
                    removed = self._evict(1 - self.free_blocks)
                    if removed:
                        events.append(RemovedRecord(tuple(removed), self.medium))
                    if self.free_blocks < 1:
                        raise KvCacheFull(1, self.free_blocks)
                    allocation._private += 1
                    self._private_blocks += 1
                allocation._tail.append(tok)
                allocation.num_tokens += 1
                if len(allocation._tail) == bs:
                    events.extend(self._seal_tail(allocation))
        finally:
            self._emit(events)

    def _seal_tail(self, alloc: Allocation) -> list[KvEventRecord]:
        parent = alloc.block_hashes[-1] if alloc.block_hashes else None
        index = len(alloc.block_hashes)
        extra = block_extra_keys(index, self.block_size, alloc.media_hashes, alloc.cache_salt)
        h = block_hash(parent, alloc._tail, lora_id=alloc.lora_id, extra_keys=extra)
        tokens = tuple(alloc._tail)
        alloc._tail = []
        alloc.block_hashes.append(h)
        alloc._private -= 1
        self._private_blocks -= 1
        alloc._pinned.append(h)
        if h in self._blocks:
            self._pin(h)
            return []
        self._blocks[h] = _Block(
            parent=parent,
            refs=1,
            token_ids=tokens,
            lora_id=alloc.lora_id,
            lora_name=alloc.lora_name,
            extra_keys=extra,
        )
        self._pinned_blocks += 1
        return [
            StoredRecord(
                block_hashes=(h,),
                parent_block_hash=parent,
                token_ids=tokens,
                block_size=self.block_size,
                lora_id=alloc.lora_id,
                lora_name=alloc.lora_name,
                medium=self.medium,
                extra_keys=(extra,) if extra else None,
                cache_salt=alloc.cache_salt,
                session_id=alloc.request_id if alloc.cache_salt is not None else None,
            )
        ]

    def release(self, allocation: Allocation) -> None:
        """Unpin the request's blocks (they stay cached, evictable, tail first). Idempotent."""
        if allocation.released:
            return
        allocation.released = True
        self._live.pop(id(allocation), None)
        for h in reversed(allocation._pinned):
            block = self._blocks.get(h)
            if block is None:
                continue
            block.refs -= 1
            if block.refs == 0:
                self._pinned_blocks -= 1
                self._evictable[h] = None
        allocation._pinned = []
        for h in allocation._detached:
            refs = self._detached_refs[h] - 1
            if refs:
                self._detached_refs[h] = refs
            else:
                del self._detached_refs[h]
        allocation._detached = []
        self._private_blocks -= allocation._private
        allocation._private = 0

    def clear(self) -> None:
        """Drop every cached block (``AllBlocksCleared``).

        Blocks still used by live requests stay allocated (uncached, still counted
        in ``used_blocks``) until those requests are released.
        """
        for alloc in self._live.values():
            for h in alloc._pinned:
                self._detached_refs[h] = self._detached_refs.get(h, 0) + 1
            alloc._detached.extend(alloc._pinned)
            alloc._pinned = []
        self._blocks.clear()
        self._evictable.clear()
        self._pinned_blocks = 0
        self._emit([ClearedRecord()])

    def snapshot_events(self) -> list[StoredRecord]:
        """The current contents as ``BlockStored`` events, one per block, parents before children."""
        depth: dict[int, int] = {}
        for h in self._blocks:
            path: list[int] = []
            cur: int | None = h
            while cur is not None and cur in self._blocks and cur not in depth:
                path.append(cur)
                cur = self._blocks[cur].parent
            base = depth.get(cur, 0) if cur is not None else 0
            for node in reversed(path):
                base += 1
                depth[node] = base
        out: list[StoredRecord] = []
        for h in sorted(self._blocks, key=depth.__getitem__):
            b = self._blocks[h]
            out.append(
                StoredRecord(
                    block_hashes=(h,),
                    parent_block_hash=b.parent,
                    token_ids=b.token_ids,
                    block_size=self.block_size,
                    lora_id=b.lora_id,
                    lora_name=b.lora_name,
                    medium=self.medium,
                    extra_keys=(b.extra_keys,) if b.extra_keys else None,
                )
            )
        return out

    # ---- internals
    def _pin(self, h: int) -> None:
        block = self._blocks[h]
        if block.refs == 0:
            self._evictable.pop(h, None)
            self._pinned_blocks += 1
        block.refs += 1

    def _evict(self, count: int) -> list[int]:
        removed: list[int] = []
        while count > 0 and self._evictable:
            h, _ = self._evictable.popitem(last=False)
            del self._blocks[h]
            removed.append(h)
            count -= 1
        return removed

    def _stored(
        self,
        alloc: Allocation,
        hashes: list[int],
        run: list[int],
        token_ids: Sequence[int],
        extras: list[tuple[str, ...]],
    ) -> StoredRecord:
        bs = self.block_size
        first, last = run[0], run[-1]
        run_extras = [extras[i] for i in run]
        return StoredRecord(
            block_hashes=tuple(hashes[i] for i in run),
            parent_block_hash=hashes[first - 1] if first else None,
            token_ids=tuple(token_ids[first * bs : (last + 1) * bs]),
            block_size=bs,
            lora_id=alloc.lora_id,
            lora_name=alloc.lora_name,
            medium=self.medium,
            extra_keys=tuple(k or None for k in run_extras) if any(run_extras) else None,
            cache_salt=alloc.cache_salt,
            session_id=alloc.request_id if alloc.cache_salt is not None else None,
        )
