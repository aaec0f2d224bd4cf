"""OpenEngine-native KV events (``pb.KvEventBatch``) into the bridge's model (vLLM's map form).

The one place the bridge re-encodes what an engine sent. Field mapping (kv.proto; proto3
cannot tell "unset" from zero, so zero values of the optional-in-vLLM fields become
``None`` and are omitted from the output; the table is in docs/KVBRIDGE.md):

- ``KvBlockHash{value, encoding}``: ``int64`` / ``uint64`` (also ``i64``, ``u64``, ``int``,
  ``uint``) is 1-8 big-endian bytes read as an unsigned int — the value vLLM's own ZMQ
  publisher writes for the same hash (the binary form does not say whether the engine's
  int was signed); ``decimal`` / ``decimal_int64`` / ``decimal_uint64`` is ASCII decimal,
  published as written, sign included (how an engine with signed hashes keeps them);
  ``string`` / ``utf8`` is decimal text when it parses as one, else its bytes; ``bytes``,
  ``hex``, ``engine_specific``, an empty or unknown encoding keep ``value`` as raw bytes.
  An empty parent hash means "no parent".
- ``medium``: ``STORAGE_MEDIUM_GPU`` -> ``"GPU"``, ``CPU_PINNED`` / ``DISK`` / ``EXTERNAL``
  likewise; unspecified or unknown -> ``None``.
- ``lora_id`` 0 and ``lora_name`` "" -> ``None``; ``group_idx`` 0, ``kv_cache_spec_kind`` "",
  ``kv_cache_spec_sliding_window`` 0 and an empty ``extra_keys`` -> not written;
  ``extra_keys`` tuples become lists, an empty tuple ``None``.
- ``timestamp_unix_nanos`` -> ``ts`` in float seconds. ``KvEvent.request_id`` and
  ``kv_session`` (a KV *transfer* session: handoff endpoints, not the routing session
  vLLM's ``session_id`` names) have no place in vLLM's format and are not forwarded;
  vLLM's ``locality``, ``ownership``, ``session_id`` have no field in kv.proto.
"""

from __future__ import annotations

from typing import Any, cast

import betterproto2
from msgspec import UNSET

from sidecar.kvbridge.errors import KvDecodeError
from sidecar.kvbridge.events import (
    CLEARED,
    BlockHash,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KvEvent,
)
from sidecar.openengine import pb

_INT_ENCODINGS = frozenset({"int64", "uint64", "i64", "u64", "int", "uint"})
_DECIMAL_ENCODINGS = frozenset({"decimal", "decimal_int64", "decimal_uint64", "decimal_u64", "decimal_i64"})
_TEXT_ENCODINGS = frozenset({"string", "str", "utf8", "utf-8", "text"})

_MEDIUM: dict[int, str] = {
    int(pb.StorageMedium.GPU): "GPU",
    int(pb.StorageMedium.CPU_PINNED): "CPU_PINNED",
    int(pb.StorageMedium.DISK): "DISK",
    int(pb.StorageMedium.EXTERNAL): "EXTERNAL",
}


def _decimal(text: str) -> int | None:
    t = text.strip()
    body = t[1:] if t[:1] in "+-" else t
    if not body or not body.isascii() or not body.isdigit():
        return None
    value = int(t)
    if not -(1 << 63) <= value < (1 << 64):
        return None
    return value


def block_hash_from_proto(h: pb.KvBlockHash) -> BlockHash:
    """One ``KvBlockHash`` as an int or raw bytes (see the module rules)."""
    enc = h.encoding.strip().lower()
    value = h.value
    if enc in _INT_ENCODINGS:
        if not 1 <= len(value) <= 8:
            raise KvDecodeError(
                f"block hash with encoding {h.encoding!r} has {len(value)} bytes, expected 1-8"
            )
        return int.from_bytes(value, "big")
    if enc in _DECIMAL_ENCODINGS or enc in _TEXT_ENCODINGS:
        try:
            text = value.decode("utf-8")
        except UnicodeDecodeError as err:
            raise KvDecodeError(f"block hash with encoding {h.encoding!r} is not UTF-8") from err
        parsed = _decimal(text)
        if parsed is not None:
            return parsed
        if enc in _DECIMAL_ENCODINGS:
            raise KvDecodeError(f"block hash {text[:40]!r} is not a 64-bit decimal integer")
        return value
    return value


def _hashes(hs: list[pb.KvBlockHash]) -> list[BlockHash]:
    out: list[BlockHash] = []
    for h in hs:
        if not h.value and not h.encoding:
            raise KvDecodeError("empty block hash")
        out.append(block_hash_from_proto(h))
    return out


def _medium(value: object) -> str | None:
    try:
        return _MEDIUM.get(int(value))  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return None


def event_from_proto(ev: pb.KvEvent) -> KvEvent:
    """One ``pb.KvEvent``; raises :class:`KvDecodeError` when it carries no event."""
    name, value = betterproto2.which_one_of(ev, "event")
    if name == "block_stored":
        s = cast(pb.BlockStored, value)
        parent = s.parent_block_hash
        extra: Any = UNSET
        if s.extra_keys:
            extra = [list(t.values) if t.values else None for t in s.extra_keys]
        return BlockStored(
            _hashes(s.block_hashes),
            block_hash_from_proto(parent)
            if parent is not None and (parent.value or parent.encoding)
            else None,
            list(s.token_ids),
            s.block_size,
            s.lora_id or None,
            _medium(s.medium),
            s.lora_name or None,
            extra,
            s.group_idx or UNSET,
            s.kv_cache_spec_kind or UNSET,
            s.kv_cache_spec_sliding_window or UNSET,
        )
    if name == "block_removed":
        r = cast(pb.BlockRemoved, value)
        return BlockRemoved(_hashes(r.block_hashes), _medium(r.medium), r.group_idx or UNSET)
    if name == "all_blocks_cleared":
        return CLEARED
    raise KvDecodeError("KvEvent carries no event")


def batch_from_proto(batch: pb.KvEventBatch) -> EventBatch:
    """A ``pb.KvEventBatch`` as an :class:`EventBatch` (its ``data_parallel_rank`` kept).

    Raises :class:`KvDecodeError` for an event without a kind or a malformed hash."""
    return EventBatch(
        batch.timestamp_unix_nanos / 1e9,
        [event_from_proto(e) for e in batch.events],
        batch.data_parallel_rank,
    )
