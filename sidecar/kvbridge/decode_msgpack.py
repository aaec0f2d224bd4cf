"""Validation of engine ZMQ KV-event payloads (msgpack) into a decoded view.

Accepted shapes (docs/design/engine-facts.md "KV events over ZMQ"):

- batch ``[ts, events]`` or ``[ts, events, dp_rank]`` (SGLang names the third field
  ``attn_dp_rank``; same slot), or, leniently, a map with ``ts`` / ``events`` / a rank key;
- events as tagged arrays ``["BlockStored", block_hashes, parent_block_hash, token_ids,
  block_size, lora_id, medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind,
  kv_cache_spec_sliding_window]`` (trailing fields may be omitted), ``["BlockRemoved",
  block_hashes, medium, group_idx]``, ``["AllBlocksCleared"]``; or as maps tagged by
  ``"type"`` with defaulted fields omitted; both kinds may even be mixed in one batch;
- block hashes as ints (msgpack int64 or uint64: signed or unsigned, kept as sent) or bytes;
- older SGLang's ``{cache_salt, session_id}`` map in the ``lora_name`` slot (or under a
  ``metadata`` key), shown as :attr:`BlockStored.metadata` in the view.

The decoded :class:`EventBatch` is a validated *view* of the payload: the bridge publishes
the payload itself (:mod:`sidecar.kvbridge.events`), so what the view leaves out — fields
it does not know, the form — still reaches consumers. :attr:`MsgpackBatchDecoder.form` says
which form the source's events take (for the ``AllBlocksCleared`` the bridge adds).

Any payload that does not decode — malformed, wrong types, nesting too deep for msgspec
(``RecursionError``) or deeper than :data:`MAX_NESTING` in the free-form fields — is a
:class:`KvDecodeError`, never another exception.

Fast path: typed msgspec decoding straight into the view (the map form: no per-event
Python work), then maps carrying older SGLang's metadata map, then tagged arrays; the
decoder remembers which one the source uses. Anything else (mixed batches, a
map-shaped batch) falls back to a generic decode and per-event conversion. In the view,
unknown trailing array fields and unknown map keys are left out, a ``None`` in an array's
optional slot is a placeholder (``UNSET``), an explicit ``None`` in a map is kept.
"""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import UNSET, UnsetType

from sidecar.kvbridge.errors import KvDecodeError
from sidecar.kvbridge.events import (
    CLEARED,
    BlockHash,
    BlockRemoved,
    BlockStored,
    EventBatch,
    Form,
    KvEvent,
)
from sidecar.quoting import clip

# -- wire models ------------------------------------------------------------------------------


class _MapStored(msgspec.Struct, tag="BlockStored", tag_field="type", gc=False):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None = None
    token_ids: list[int] = []
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | dict[str, object] | None = None
    extra_keys: list[object] | UnsetType | None = UNSET
    group_idx: int | UnsetType | None = UNSET
    kv_cache_spec_kind: str | UnsetType | None = UNSET
    kv_cache_spec_sliding_window: int | UnsetType | None = UNSET
    metadata: dict[str, object] | UnsetType | None = UNSET


class _MapRemoved(msgspec.Struct, tag="BlockRemoved", tag_field="type", gc=False):
    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | UnsetType | None = UNSET


class _MapCleared(msgspec.Struct, tag="AllBlocksCleared", tag_field="type", gc=False):
    pass


class _ArrStored(msgspec.Struct, array_like=True, tag="BlockStored", gc=False):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None = None
    token_ids: list[int] = []
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | dict[str, object] | None = None
    extra_keys: list[object] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class _ArrRemoved(msgspec.Struct, array_like=True, tag="BlockRemoved", gc=False):
    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | None = None


class _ArrCleared(msgspec.Struct, array_like=True, tag="AllBlocksCleared", gc=False):
    pass


_MapEvent = _MapStored | _MapRemoved | _MapCleared
_ArrEvent = _ArrStored | _ArrRemoved | _ArrCleared


class _MapBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_MapEvent]
    data_parallel_rank: int | None = None


class _ArrBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_ArrEvent]
    data_parallel_rank: int | None = None


_RANK_KEYS = ("data_parallel_rank", "attn_dp_rank", "dp_rank")

# -- conversion to the view ---------------------------------------------------------------------


def _opt(value: Any) -> Any:
    """An optional field from a tagged array: a None there is only a placeholder."""
    return UNSET if value is None else value


def _stored(e: _MapStored | _ArrStored) -> BlockStored:
    lora_name = e.lora_name
    parent = e.parent_block_hash
    if type(e) is _MapStored:
        metadata: Any = e.metadata if e.metadata is not None else UNSET
        extra = (e.extra_keys, e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window)
    else:
        metadata = UNSET
        extra = tuple(
            _opt(v) for v in (e.extra_keys, e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window)
        )
    if isinstance(lora_name, dict):  # SGLang: metadata map in the lora_name slot
        if metadata is UNSET:
            metadata = lora_name
        lora_name = None
    return BlockStored(
        e.block_hashes,
        parent,
        e.token_ids,
        e.block_size,
        e.lora_id,
        e.medium,
        lora_name,
        *extra,
        metadata,
    )


def _normalize(events: list[Any]) -> list[KvEvent]:
    out: list[KvEvent] = []
    append = out.append
    for e in events:
        t = type(e)
        if t is _MapStored or t is _ArrStored:
            append(_stored(e))
        elif t is _MapRemoved:
            append(BlockRemoved(e.block_hashes, e.medium, e.group_idx))
        elif t is _ArrRemoved:
            append(BlockRemoved(e.block_hashes, e.medium, _opt(e.group_idx)))
        else:
            append(CLEARED)
    return out


# -- decoder -----------------------------------------------------------------------------------


class MsgpackBatchDecoder:
    """Decodes one source's payloads; remembers which wire shape the source uses.

    ``decode`` returns an :class:`EventBatch` whose ``data_parallel_rank`` is the one in the
    payload (``None`` when absent) or raises :class:`KvDecodeError`. Shapes, in the order
    first tried: maps straight into the view (no per-event Python work); maps carrying
    older SGLang's metadata map; tagged arrays. :attr:`form` is the form of the last batch
    that had events (``None`` before any). Not shared between sources; not thread-safe.
    """

    __slots__ = ("_last", "_paths", "form")

    _FORMS: tuple[Form, ...] = ("map", "map", "array")

    def __init__(self) -> None:
        fast = msgspec.msgpack.Decoder(EventBatch)
        maps = msgspec.msgpack.Decoder(_MapBatch)
        arrays = msgspec.msgpack.Decoder(_ArrBatch)

        def slow(dec: msgspec.msgpack.Decoder[Any]) -> Any:
            def run(payload: bytes) -> EventBatch:
                b = dec.decode(payload)
                return EventBatch(b.ts, _normalize(b.events), b.data_parallel_rank)

            return run

        self._paths: list[Any] = [fast.decode, slow(maps), slow(arrays)]
        self._last = 0
        self.form: Form | None = None

    def decode(self, payload: bytes) -> EventBatch:
        """Raises :class:`KvDecodeError` for anything that is not a usable batch — whatever
        the decoding raised (too deep a nesting raises ``RecursionError`` in msgspec)."""
        try:
            batch, form = self._decode(payload)
        except KvDecodeError:
            raise
        except Exception as err:  # RecursionError, or anything msgspec / the conversion raise
            raise KvDecodeError(
                f"payload does not decode ({type(err).__name__}: {clip(str(err), 200)})"
            ) from err
        check_nesting(batch)
        if batch.events:
            self.form = form
        return batch

    def _decode(self, payload: bytes) -> tuple[EventBatch, Form]:
        last = self._last
        try:
            return self._paths[last](payload), self._FORMS[last]
        except msgspec.DecodeError:
            pass
        for i, path in enumerate(self._paths):
            if i == last:
                continue
            try:
                batch: EventBatch = path(payload)
            except msgspec.DecodeError:
                continue
            self._last = i
            return batch, self._FORMS[i]
        return _decode_generic(payload)


MAX_NESTING = 16
"""Deepest nesting of lists / maps allowed inside an event's ``extra_keys`` or ``metadata``
(engines send 1-3 levels); deeper batches are decode errors, so re-encoding one can never
reach the interpreter's recursion limit."""


def _nesting(value: object, depth: int = 0) -> int:
    if depth > MAX_NESTING:
        return depth
    if type(value) is list:
        return max((_nesting(v, depth + 1) for v in value), default=depth + 1)
    if type(value) is dict:
        return max((_nesting(v, depth + 1) for v in value.values()), default=depth + 1)
    return depth


def check_nesting(batch: EventBatch) -> None:
    """Raise :class:`KvDecodeError` when an event carries free-form data nested past :data:`MAX_NESTING`."""
    for e in batch.events:
        if type(e) is BlockStored:
            extra, metadata = e.extra_keys, e.metadata
            if (type(extra) is list and _nesting(extra) > MAX_NESTING) or (
                type(metadata) is dict and _nesting(metadata) > MAX_NESTING
            ):
                raise KvDecodeError(f"event data nested deeper than {MAX_NESTING} levels")


def _decode_generic(payload: bytes) -> tuple[EventBatch, Form]:
    """Slow path: mixed event kinds in one batch, a map-shaped batch, or a malformed payload."""
    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as err:
        raise KvDecodeError(f"payload is not msgpack: {err}") from err
    rank: object = None
    if isinstance(raw, list):
        if len(raw) < 2:
            raise KvDecodeError(f"batch array has {len(raw)} fields, expected [ts, events, dp_rank?]")
        ts, events = raw[0], raw[1]
        if len(raw) > 2:
            rank = raw[2]
    elif isinstance(raw, dict):
        ts, events = raw.get("ts"), raw.get("events")
        for key in _RANK_KEYS:
            if raw.get(key) is not None:
                rank = raw[key]
                break
    else:
        raise KvDecodeError(f"batch is a {type(raw).__name__}, expected an array")
    if isinstance(ts, bool) or not isinstance(ts, int | float):
        raise KvDecodeError("batch timestamp is not a number")
    if not isinstance(events, list):
        raise KvDecodeError("batch events is not an array")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)):
        raise KvDecodeError("batch dp_rank is not an int")
    typed: list[Any] = []
    for i, ev in enumerate(events):
        try:
            if isinstance(ev, dict):
                typed.append(msgspec.convert(ev, _MapEvent))
            elif isinstance(ev, list):
                typed.append(msgspec.convert(ev, _ArrEvent))
            else:
                raise KvDecodeError(f"event {i} is a {type(ev).__name__}, expected a map or an array")
        except msgspec.ValidationError as err:
            raise KvDecodeError(f"event {i}: {err}") from err
    form: Form = "array" if events and isinstance(events[0], list) else "map"
    return EventBatch(float(ts), _normalize(typed), rank), form


def decode_msgpack_batch(payload: bytes) -> EventBatch:
    """Decode one payload (convenience; sources keep a :class:`MsgpackBatchDecoder`)."""
    return MsgpackBatchDecoder().decode(payload)
