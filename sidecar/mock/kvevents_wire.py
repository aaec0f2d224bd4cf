"""KV event wire formats and fault logic of the simulated engines (I/O-free).

msgpack (ZMQ, vLLM and SGLang flavours; docs/design/engine-facts.md "KV events over ZMQ"):

* frames ``[topic, seq (8 bytes big-endian), payload]``; payload
  ``[ts: float, [event, ...], dp_rank: int]`` (SGLang calls the third field
  ``attn_dp_rank``; same slot).
* events as maps tagged by ``"type"`` (vLLM >= 0.26, current SGLang): always
  ``block_hashes``, ``parent_block_hash``, ``token_ids``, ``block_size``,
  ``lora_id``, ``medium``, ``lora_name`` (``None`` allowed); ``extra_keys`` only
  when some block has extra keys (one entry per block, ``None`` for none), other
  defaulted fields (``group_idx``, ``kv_cache_spec_*``) omitted. ``BlockRemoved``:
  ``block_hashes``, ``medium``. ``AllBlocksCleared``: only the tag.
* or, with the ``kv-tagged-arrays`` fault (older engines), tagged arrays
  ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
  lora_id, medium, lora_name(, extra_keys)]`` (trailing defaulted fields
  omitted), ``["BlockRemoved", block_hashes, medium]``, ``["AllBlocksCleared"]``.
* hashes are unsigned 64-bit ints (msgpack uint64 when >= 2**63).
* SGLang style only: a salted store (``cache_salt`` set) carries the map
  ``{"cache_salt": s, "session_id": sid}`` in the ``lora_name`` slot (key
  ``"lora_name"`` in the map form, position 7 in the array form).

protobuf (``SubscribeKvEvents``): ``KvBlockHash{value = the hash's 8 bytes
big-endian, encoding = "int64"}`` (the schema's ``int64`` encoding; the same 8
bytes read as unsigned give back the ZMQ integer, ``int.from_bytes(v, "big")``),
``medium`` ``GPU`` → ``STORAGE_MEDIUM_GPU``, extra keys as one ``OpaqueKeyTuple``
per block (empty for none) when any block has some, ``lora_id`` 0 = none.

Faults (``--fault NAME[=N]``, see :class:`KvFaults`): N counts published batches
from 0 (the N-th batch is the one numbered N when nothing reset the sequence).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

import msgspec

from sidecar.mock.kvevents_model import KvEventRecord, RemovedRecord, StoredRecord
from sidecar.openengine import pb

__all__ = [
    "END_SEQ",
    "BatchHistory",
    "KvFaults",
    "KvSequencer",
    "PublishDecision",
    "Style",
    "batch_to_pb",
    "encode_payload",
    "event_to_array",
    "event_to_map",
    "event_to_pb",
    "hash_to_pb",
    "seq_bytes",
]

Style = Literal["vllm", "sglang"]
END_SEQ = b"\xff" * 8  # replay end marker (-1 as 8 bytes)
_encoder = msgspec.msgpack.Encoder()


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


def _lora_slot(ev: StoredRecord, style: Style) -> Any:
    if style == "sglang" and ev.cache_salt is not None:
        return {"cache_salt": ev.cache_salt, "session_id": ev.session_id}
    return ev.lora_name


def _extra_keys(ev: StoredRecord) -> list[list[str] | None] | None:
    if ev.extra_keys is None or not any(ev.extra_keys):
        return None
    return [list(k) if k else None for k in ev.extra_keys]


def event_to_map(ev: KvEventRecord, style: Style = "vllm") -> dict[str, Any]:
    if isinstance(ev, StoredRecord):
        out: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": list(ev.block_hashes),
            "parent_block_hash": ev.parent_block_hash,
            "token_ids": list(ev.token_ids),
            "block_size": ev.block_size,
            "lora_id": ev.lora_id,
            "medium": ev.medium,
            "lora_name": _lora_slot(ev, style),
        }
        extra = _extra_keys(ev)
        if extra is not None:
            out["extra_keys"] = extra
        return out
    if isinstance(ev, RemovedRecord):
        return {"type": "BlockRemoved", "block_hashes": list(ev.block_hashes), "medium": ev.medium}
    return {"type": "AllBlocksCleared"}


def event_to_array(ev: KvEventRecord, style: Style = "vllm") -> list[Any]:
    if isinstance(ev, StoredRecord):
        out: list[Any] = [
            "BlockStored",
            list(ev.block_hashes),
            ev.parent_block_hash,
            list(ev.token_ids),
            ev.block_size,
            ev.lora_id,
            ev.medium,
            _lora_slot(ev, style),
        ]
        extra = _extra_keys(ev)
        if extra is not None:
            out.append(extra)
        return out
    if isinstance(ev, RemovedRecord):
        return ["BlockRemoved", list(ev.block_hashes), ev.medium]
    return ["AllBlocksCleared"]


def encode_payload(
    ts: float,
    events: Sequence[KvEventRecord],
    dp_rank: int | None,
    *,
    style: Style = "vllm",
    tagged_arrays: bool = False,
    undecodable: bool = False,
) -> bytes:
    """The msgpack payload frame ``[ts, [events], dp_rank]`` (``undecodable``: plus an integer
    where an event belongs, fault ``kv-undecodable``)."""
    conv = event_to_array if tagged_arrays else event_to_map
    encoded: list[Any] = [conv(e, style) for e in events]
    return _encoder.encode([ts, [*encoded, 0] if undecodable else encoded, dp_rank])


# --------------------------------------------------------------------------- protobuf


def hash_to_pb(h: int) -> pb.KvBlockHash:
    return pb.KvBlockHash(value=h.to_bytes(8, "big"), encoding="int64")


_MEDIUM = {
    "GPU": pb.StorageMedium.GPU,
    "CPU": pb.StorageMedium.CPU_PINNED,
    "CPU_PINNED": pb.StorageMedium.CPU_PINNED,
    "DISK": pb.StorageMedium.DISK,
}


def event_to_pb(ev: KvEventRecord) -> pb.KvEvent:
    if isinstance(ev, StoredRecord):
        stored = pb.BlockStored(
            block_hashes=[hash_to_pb(h) for h in ev.block_hashes],
            parent_block_hash=None if ev.parent_block_hash is None else hash_to_pb(ev.parent_block_hash),
            token_ids=list(ev.token_ids),
            block_size=ev.block_size,
            lora_id=ev.lora_id or 0,
            lora_name=ev.lora_name or "",
            medium=_MEDIUM.get(ev.medium, pb.StorageMedium.UNSPECIFIED),
        )
        if ev.extra_keys is not None and any(ev.extra_keys):
            stored.extra_keys = [pb.OpaqueKeyTuple(values=list(k or ())) for k in ev.extra_keys]
        return pb.KvEvent(block_stored=stored)
    if isinstance(ev, RemovedRecord):
        return pb.KvEvent(
            block_removed=pb.BlockRemoved(
                block_hashes=[hash_to_pb(h) for h in ev.block_hashes],
                medium=_MEDIUM.get(ev.medium, pb.StorageMedium.UNSPECIFIED),
            )
        )
    return pb.KvEvent(all_blocks_cleared=pb.AllBlocksCleared())


def batch_to_pb(seq: int, ts_ns: int, dp_rank: int, events: Iterable[KvEventRecord]) -> pb.KvEventBatch:
    return pb.KvEventBatch(
        sequence_number=seq,
        timestamp_unix_nanos=ts_ns,
        data_parallel_rank=dp_rank,
        events=[event_to_pb(e) for e in events],
    )


#: Default size of the ``kv-large-batch`` filler: about 3 s of betterproto2 decoding.
LARGE_BATCH_BYTES = 3_000_000
#: First synthetic block hash of the filler (far from the mock's real hashes).
_FILLER_HASH = 0xF111_0000_0000_0000


def large_batch_filler(size: int, block_size: int = 16) -> bytes:
    """About ``size`` bytes of ``KvEventBatch.events`` fields (fault ``kv-large-batch``): one
    ``BlockStored`` of a chain of synthetic blocks, appended inside a batch's bytes (repeated
    fields concatenate; a message field given twice would not merge in every parser)."""
    blocks = max(1, size // 51)  # ~19 bytes of hash and ~32 of token ids per block
    stored = StoredRecord(
        block_hashes=tuple(_FILLER_HASH + i for i in range(blocks)),
        parent_block_hash=None,
        token_ids=tuple(i % 16_000 + 100 for i in range(blocks * block_size)),
        block_size=block_size,
    )
    return bytes(pb.KvEventBatch(events=[event_to_pb(stored)]))


# --------------------------------------------------------------------------- faults


@dataclass(frozen=True)
class KvFaults:
    """KV transport faults, each applied once per publisher (per rank).

    * ``kv-gap[=N]`` (``gap_at``, default 1): batch N is not sent live but stays
      in the replay buffer / resume history, so a replay or resume recovers it.
    * ``kv-publisher-restart[=N]`` (``restart_at``, default 1): before batch N the
      sequence restarts at 0 and the replay buffer / history is emptied.
    * ``kv-history-lost[=N]`` (``history_lost_at``, default 1): batch N is not sent
      live and the buffer forgets it and everything older, so a replay asked from
      N starts later (at N+1 or the next batch) and a resume from N is refused.
    * ``kv-tagged-arrays``: msgpack events as tagged arrays (ZMQ only).
    * ``kv-wrong-rank`` (``wrong_rank``): batches report DP rank + 1.
    * ``kv-replay-skip`` (``replay_skip``): a ZMQ replay or a gRPC resume from S
      starts at S + 1.
    * ``kv-large-batch[=BYTES]`` (``large_batch``, default :data:`LARGE_BATCH_BYTES`; gRPC
      only): the first batch each rank sends live carries about BYTES more of synthetic
      ``BlockStored`` events (:func:`large_batch_filler`, built once); replays do not.
    * ``kv-empty-response`` (``empty_response``; gRPC only): every stream begins with a
      response carrying no event.
    * ``kv-event-after-error`` (``event_after_error``; gRPC only): a stream with
      ``include_snapshot`` sends, after its snapshot, an ``EngineError`` and one more batch.
    * ``kv-undecodable`` (``undecodable``): the first batch of each rank carries one more
      event that does not decode (gRPC: a ``KvEvent`` with none set; ZMQ: an integer).
    """

    gap_at: int | None = None
    restart_at: int | None = None
    history_lost_at: int | None = None
    tagged_arrays: bool = False
    wrong_rank: bool = False
    replay_skip: bool = False
    large_batch: int | None = None
    empty_response: bool = False
    event_after_error: bool = False
    undecodable: bool = False

    NAMES = (
        "kv-gap",
        "kv-publisher-restart",
        "kv-history-lost",
        "kv-tagged-arrays",
        "kv-wrong-rank",
        "kv-replay-skip",
        "kv-large-batch",
        "kv-empty-response",
        "kv-event-after-error",
        "kv-undecodable",
    )
    _FLAGS = {
        "kv-tagged-arrays": "tagged_arrays",
        "kv-wrong-rank": "wrong_rank",
        "kv-replay-skip": "replay_skip",
        "kv-empty-response": "empty_response",
        "kv-event-after-error": "event_after_error",
        "kv-undecodable": "undecodable",
    }

    @property
    def rank_offset(self) -> int:
        """What the ``kv-wrong-rank`` fault adds to every reported DP rank."""
        return 1 if self.wrong_rank else 0

    @property
    def replay_offset(self) -> int:
        """What the ``kv-replay-skip`` fault adds to a replay / resume start."""
        return 1 if self.replay_skip else 0

    DEFAULTS = {
        "kv-gap": 1,
        "kv-publisher-restart": 1,
        "kv-history-lost": 1,
        "kv-large-batch": LARGE_BATCH_BYTES,
    }

    @classmethod
    def from_options(cls, faults: Mapping[str, str | None] | Iterable[tuple[str, str | None]]) -> KvFaults:
        """Build from ``--fault NAME[=VALUE]`` pairs; names not starting with ``kv-`` are ignored.

        Raises ``ValueError`` for an unknown ``kv-`` name or a value that is not a
        non-negative integer.
        """
        items = faults.items() if isinstance(faults, Mapping) else faults
        values: dict[str, Any] = {}
        for name, value in items:
            if not name.startswith("kv-"):
                continue
            if name not in cls.NAMES:
                raise ValueError(f"unknown KV fault {name!r} (known: {', '.join(cls.NAMES)})")
            if name in cls._FLAGS:
                values[cls._FLAGS[name]] = True
                continue
            n = cls.DEFAULTS[name] if value in (None, "") else int(value)  # type: ignore[arg-type]
            if n < 0:
                raise ValueError(f"{name} needs a non-negative batch number")
            attr = {
                "kv-gap": "gap_at",
                "kv-publisher-restart": "restart_at",
                "kv-large-batch": "large_batch",
            }.get(name, "history_lost_at")
            values[attr] = n
        return cls(**values)

    @classmethod
    def from_kv_options(cls, options: Mapping[str, object], *, tagged_arrays: bool = False) -> KvFaults:
        """From ``sidecar.mock.faults.Faults.kv_options()``: ``kv_gap`` / ``kv_publisher_restart``
        (int), ``kv_history_lost`` (``True`` = default batch, or an int), ``kv_tagged_arrays`` (bool)."""

        def _at(key: str, default: int) -> int | None:
            value = options.get(key)
            if value is None or value is False:
                return None
            if value is True:
                return default
            return int(value)  # type: ignore[call-overload]

        return cls(
            gap_at=_at("kv_gap", cls.DEFAULTS["kv-gap"]),
            restart_at=_at("kv_publisher_restart", cls.DEFAULTS["kv-publisher-restart"]),
            history_lost_at=_at("kv_history_lost", cls.DEFAULTS["kv-history-lost"]),
            tagged_arrays=tagged_arrays or bool(options.get("kv_tagged_arrays")),
            wrong_rank=bool(options.get("kv_wrong_rank")),
            replay_skip=bool(options.get("kv_replay_skip")),
            large_batch=_at("kv_large_batch", LARGE_BATCH_BYTES),
            empty_response=bool(options.get("kv_empty_response")),
            event_after_error=bool(options.get("kv_event_after_error")),
            undecodable=bool(options.get("kv_undecodable")),
        )


T = TypeVar("T")


class BatchHistory(Generic[T]):
    """The last ``steps`` batches by sequence number (ascending)."""

    def __init__(self, steps: int) -> None:
        if steps <= 0:
            raise ValueError("buffer steps must be positive")
        self._items: deque[tuple[int, T]] = deque(maxlen=steps)

    def append(self, seq: int, item: T) -> None:
        self._items.append((seq, item))

    def since(self, start: int) -> list[tuple[int, T]]:
        """Held batches with ``seq >= start`` (a too-old start yields the oldest held first)."""
        return [(s, it) for s, it in self._items if s >= start]

    def purge_through(self, seq: int) -> None:
        while self._items and self._items[0][0] <= seq:
            self._items.popleft()

    def clear(self) -> None:
        self._items.clear()

    @property
    def oldest(self) -> int | None:
        return self._items[0][0] if self._items else None

    def __len__(self) -> int:
        return len(self._items)


@dataclass(frozen=True)
class PublishDecision:
    seq: int
    send_live: bool
    restarted: bool


class KvSequencer(Generic[T]):
    """Numbers one rank's batches and applies :class:`KvFaults` to the live stream and buffer."""

    def __init__(self, buffer: BatchHistory[T], faults: KvFaults) -> None:
        self.buffer = buffer
        self.faults = faults
        self.next_seq = 0
        self.published = 0
        self._done: set[str] = set()

    def _once(self, name: str, at: int | None) -> bool:
        if at is None or at != self.published or name in self._done:
            return False
        self._done.add(name)
        return True

    def next_batch(self, item: T) -> PublishDecision:
        restarted = self._once("restart", self.faults.restart_at)
        if restarted:
            self.next_seq = 0
            self.buffer.clear()
        seq = self.next_seq
        self.next_seq += 1
        self.buffer.append(seq, item)
        live = True
        if self._once("gap", self.faults.gap_at):
            live = False
        if self._once("lost", self.faults.history_lost_at):
            live = False
            self.buffer.purge_through(seq)
        self.published += 1
        return PublishDecision(seq=seq, send_live=live, restarted=restarted)
