"""The bridge's normalized KV event model, which is also its output format.

One model for every source (vLLM / SGLang ZMQ msgpack, OpenEngine protobuf): msgspec
Structs that encode exactly as vLLM's ZMQ KV events in their tagged-map form
(docs/KVBRIDGE.md, docs/design/engine-facts.md "KV events over ZMQ"):

- payload ``[ts, [event...], dp_rank]`` (an array),
- each event a map tagged by ``"type"``: ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``.

The fields vLLM's own event Structs declare without a default (``block_hashes``,
``parent_block_hash``, ``token_ids``, ``block_size``, ``lora_id``, ``medium``, ``lora_name``)
are always written, ``None`` included, so consumers that decode with vLLM's definitions work;
the later optional ones (``extra_keys``, ``group_idx``, ``kv_cache_spec_kind``,
``kv_cache_spec_sliding_window``) and SGLang's ``metadata`` map only when the engine gave
them (``UNSET`` otherwise; an explicit ``None`` in a map-form event is kept).

Block hashes are unsigned 64-bit ints (a negative int64 from an engine is taken modulo
2**64, the same identity consumers such as Dynamo use) or raw ``bytes`` when the engine
hashes to bytes; the bridge never turns one kind into the other.
"""

from __future__ import annotations

from typing import Annotated, Any, TypeAlias

import msgspec
from msgspec import UNSET, UnsetType

BlockHash: TypeAlias = int | bytes
"""An engine block hash: an unsigned 64-bit int, or raw bytes."""

_U64 = Annotated[int, msgspec.Meta(ge=0)]
_Hash: TypeAlias = _U64 | bytes  # negative ints fail here: the decoder's slow path normalizes them

U64_MASK = (1 << 64) - 1


class BlockStored(msgspec.Struct, tag="BlockStored", tag_field="type", gc=False):
    """Blocks entered a cache medium. ``token_ids`` holds ``block_size * len(block_hashes)`` ids.

    Also the decoder's fast path for vLLM's map form, hence the defaults. ``UNSET`` fields
    are not written.
    """

    block_hashes: list[_Hash]
    parent_block_hash: _Hash | None = None
    token_ids: list[int] = []
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | UnsetType | None = UNSET
    """Per block: a tuple (list) of extra hash inputs — multimodal hashes, LoRA, cache salt — or None."""
    group_idx: int | UnsetType | None = UNSET
    kv_cache_spec_kind: str | UnsetType | None = UNSET
    kv_cache_spec_sliding_window: int | UnsetType | None = UNSET
    metadata: dict[str, Any] | UnsetType = UNSET
    """SGLang's per-store metadata (``cache_salt``, ``session_id``); SGLang sends it in the lora_name slot."""


class BlockRemoved(msgspec.Struct, tag="BlockRemoved", tag_field="type", gc=False):
    """Blocks left a cache medium."""

    block_hashes: list[_Hash]
    medium: str | None = None
    group_idx: int | UnsetType | None = UNSET


class AllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", tag_field="type", gc=False):
    """Every block of this rank is gone (or: the bridge lost history and consumers must forget)."""


KvEvent: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True, gc=False):
    """One published step: ``[ts, events, data_parallel_rank]`` on the wire."""

    ts: float
    events: list[KvEvent]
    data_parallel_rank: int | None = None


CLEARED = AllBlocksCleared()


def u64(value: int) -> int:
    """An int block hash in the unsigned 64-bit range (negative int64 -> two's complement)."""
    return value & U64_MASK if value < 0 else value


def norm_hash(value: BlockHash) -> BlockHash:
    """Normalize one block hash (ints to unsigned 64-bit, bytes unchanged)."""
    if type(value) is int and value < 0:
        return value & U64_MASK
    return value


def norm_hashes(values: list[BlockHash]) -> list[BlockHash]:
    """Normalize a list of block hashes; returns the same list when nothing changes (the common case)."""
    for h in values:
        if type(h) is int and h < 0:
            return [norm_hash(v) for v in values]
    return values


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(EventBatch)


def encode_batch(batch: EventBatch) -> bytes:
    """The msgpack payload of one output batch."""
    return _encoder.encode(batch)


def decode_output_batch(payload: bytes) -> EventBatch:
    """Decode a payload in the bridge's own output format (tests, tools)."""
    return _decoder.decode(payload)


def cleared_batch(ts: float, rank: int | None) -> EventBatch:
    """A batch holding one ``AllBlocksCleared``: what the bridge publishes when history is lost."""
    return EventBatch(ts=ts, events=[CLEARED], data_parallel_rank=rank)
