"""The bridge's KV event model and its output payloads.

What goes out (docs/KVBRIDGE.md "Output format"):

- A batch from a ZMQ (msgpack) source goes out as the engine wrote it — the same bytes —
  except for the rank slot: the payload is an array ``[ts, events, rank, ...]`` whose third
  element the bridge sets to the rank it publishes for (:func:`with_rank`; untouched when
  the engine already wrote that rank). Events, their form (tagged maps or tagged arrays),
  every field (known to the bridge or not), hash signedness and bytes hashes pass through.
- A batch the bridge makes itself — from ``SubscribeKvEvents`` (protobuf), or an
  ``AllBlocksCleared`` after lost history — is encoded from :class:`EventBatch`: vLLM's
  tagged-map form (an ``AllBlocksCleared`` follows the source's form, :func:`cleared_payload`).
- The idle heartbeat is ``[ts, [], rank]`` (:func:`heartbeat_payload`): no events.

:class:`EventBatch` and its event Structs are also the decoded *view* of an engine batch
(the decoders validate into it; the conformance watcher reads it). In it, the fields vLLM's
own event Structs declare without a default (``block_hashes``, ``parent_block_hash``,
``token_ids``, ``block_size``, ``lora_id``, ``medium``, ``lora_name``) are always written,
``None`` included, so consumers that decode with vLLM's definitions work; the later
optional ones (``extra_keys``, ``group_idx``, ``kv_cache_spec_kind``,
``kv_cache_spec_sliding_window``) and SGLang's ``metadata`` map only when set (``UNSET``
otherwise). Block hashes are ints as the engine gave them (signed or unsigned 64-bit) or
raw ``bytes``; the bridge never turns one kind into another.
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple, TypeAlias

import msgspec
from msgspec import UNSET, Raw, UnsetType

BlockHash: TypeAlias = int | bytes
"""An engine block hash: a 64-bit int (signed or unsigned, as sent), or raw bytes."""

Form: TypeAlias = Literal["map", "array"]
"""How a source writes its events: tagged maps (vLLM >= 0.26, SGLang) or tagged arrays (older)."""


class BlockStored(msgspec.Struct, tag="BlockStored", tag_field="type", gc=False):
    """Blocks entered a cache medium. ``token_ids`` holds ``block_size * len(block_hashes)`` ids.

    Also the decoder's fast path for the engines' map form, hence the defaults. ``UNSET``
    fields are not written.
    """

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None = None
    token_ids: list[int] = []
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[object] | UnsetType | None = UNSET
    """Per block: a tuple (list) of extra hash inputs — multimodal hashes, LoRA, cache salt — or None."""
    group_idx: int | UnsetType | None = UNSET
    kv_cache_spec_kind: str | UnsetType | None = UNSET
    kv_cache_spec_sliding_window: int | UnsetType | None = UNSET
    metadata: dict[str, object] | UnsetType = UNSET
    """Older SGLang's per-store map (``cache_salt``, ``session_id``), sent in the lora_name slot."""


class BlockRemoved(msgspec.Struct, tag="BlockRemoved", tag_field="type", gc=False):
    """Blocks left a cache medium."""

    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | UnsetType | None = UNSET


class AllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", tag_field="type", gc=False):
    """Every block of this rank is gone (or: the bridge lost history and consumers must forget)."""


KvEvent: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True, gc=False):
    """One step: ``[ts, events, data_parallel_rank]`` on the wire."""

    ts: float
    events: list[KvEvent]
    data_parallel_rank: int | None = None


class OutBatch(NamedTuple):
    """One batch for the publisher: its output payload, how many events it holds, the engine's time."""

    payload: bytes
    events: int
    ts: float


CLEARED = AllBlocksCleared()

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(EventBatch)
_envelope = msgspec.msgpack.Decoder(list[Raw] | dict[str, Raw])
_CLEARED_ARRAY = ["AllBlocksCleared"]
_ARRAY_HEADS = frozenset({*(bytes([b]) for b in range(0x90, 0xA0)), b"\xdc", b"\xdd"})
"""First bytes of a msgpack array (fixarray, array 16, array 32)."""


def encode_batch(batch: EventBatch) -> bytes:
    """The msgpack payload of a batch the bridge encodes itself (vLLM's tagged-map form)."""
    return _encoder.encode(batch)


def decode_output_batch(payload: bytes) -> EventBatch:
    """Decode a payload in the map form with the bridge's model (tests, tools)."""
    return _decoder.decode(payload)


def published_payload(payload: bytes, payload_rank: int | None, rank: int) -> bytes:
    """What the bridge publishes for a validated engine payload whose rank slot holds
    ``payload_rank``: the payload itself when it is an array already carrying ``rank``,
    else :func:`with_rank`."""
    if payload_rank == rank and payload[:1] in _ARRAY_HEADS:
        return payload
    return with_rank(payload, rank)


def with_rank(payload: bytes, rank: int) -> bytes:
    """An engine payload with its rank slot (third element) set to ``rank``, nothing else changed.

    ``[ts, events]`` gains the slot; elements after it are kept as they are. A map-shaped
    batch (``{"ts", "events", rank key}``) becomes ``[ts, events, rank]``. The caller has
    validated ``payload`` (raises ``msgspec.DecodeError`` / ``KeyError`` otherwise).
    """
    raw = _envelope.decode(payload)
    if isinstance(raw, dict):
        return _encoder.encode([raw["ts"], raw["events"], rank])
    return _encoder.encode([raw[0], raw[1], rank, *raw[3:]])


def cleared_payload(ts: float, rank: int, form: Form = "map") -> bytes:
    """One ``AllBlocksCleared`` in the source's form: what the bridge publishes when history is lost."""
    event: Any = _CLEARED_ARRAY if form == "array" else CLEARED
    return _encoder.encode([ts, [event], rank])


def heartbeat_payload(ts: float, rank: int) -> bytes:
    """The idle heartbeat: a batch with no events."""
    return _encoder.encode([ts, [], rank])
