"""KV event records of the simulated engines and their ground-truth log (I/O-free but for the log file).

:class:`StoredRecord` / :class:`RemovedRecord` / :class:`ClearedRecord` (an engine's
``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``; named apart from the protobuf
messages and the KV bridge's event types) are what a ``sidecar.mock.kvcache.KvCache`` reports; the transports encode them
(``sidecar.mock.kvevents_wire``). :class:`KvGroundTruth` records every batch, in
order, per rank, before any transport fault: tests judge the KV bridge against it.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = [
    "MEDIUM_GPU",
    "ClearedRecord",
    "KvEventRecord",
    "KvEventSink",
    "KvGroundTruth",
    "RemovedRecord",
    "StoredRecord",
    "event_from_json",
    "event_to_json",
    "load_ground_truth",
]

MEDIUM_GPU = "GPU"


# --------------------------------------------------------------------------- events


@dataclass(frozen=True, slots=True)
class StoredRecord:
    """New cached blocks, contiguous in one chain (vLLM's ``BlockStored``).

    ``token_ids`` has ``block_size * len(block_hashes)`` entries; ``extra_keys`` is
    ``None`` or one entry per block (``None`` for a block without extra keys).
    ``cache_salt`` / ``session_id`` feed SGLang's ``metadata`` map.
    """

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    lora_name: str | None = None
    medium: str = MEDIUM_GPU
    extra_keys: tuple[tuple[str, ...] | None, ...] | None = None
    cache_salt: str | None = None
    session_id: str | None = None


@dataclass(frozen=True, slots=True)
class RemovedRecord:
    """Blocks evicted from the cache."""

    block_hashes: tuple[int, ...]
    medium: str = MEDIUM_GPU


@dataclass(frozen=True, slots=True)
class ClearedRecord:
    """Every cached block is gone."""


KvEventRecord = StoredRecord | RemovedRecord | ClearedRecord


class KvEventSink(Protocol):
    """Receives each batch of a rank's events, in order; returns the batch's sequence number, if any."""

    def publish(self, dp_rank: int, events: Sequence[KvEventRecord]) -> int | None: ...


def event_to_json(event: KvEventRecord) -> dict[str, Any]:
    """vLLM-style map (``"type"`` tag, hashes as unsigned ints, defaulted fields omitted)."""
    if isinstance(event, StoredRecord):
        out: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": list(event.block_hashes),
            "parent_block_hash": event.parent_block_hash,
            "token_ids": list(event.token_ids),
            "block_size": event.block_size,
            "lora_id": event.lora_id,
            "medium": event.medium,
            "lora_name": event.lora_name,
        }
        if event.extra_keys is not None:
            out["extra_keys"] = [None if k is None else list(k) for k in event.extra_keys]
        if event.cache_salt is not None:
            out["cache_salt"] = event.cache_salt
        if event.session_id is not None:
            out["session_id"] = event.session_id
        return out
    if isinstance(event, RemovedRecord):
        return {"type": "BlockRemoved", "block_hashes": list(event.block_hashes), "medium": event.medium}
    return {"type": "AllBlocksCleared"}


def event_from_json(data: dict[str, Any]) -> KvEventRecord:
    """Inverse of :func:`event_to_json`."""
    kind = data["type"]
    if kind == "BlockStored":
        extra = data.get("extra_keys")
        return StoredRecord(
            block_hashes=tuple(data["block_hashes"]),
            parent_block_hash=data.get("parent_block_hash"),
            token_ids=tuple(data["token_ids"]),
            block_size=data["block_size"],
            lora_id=data.get("lora_id"),
            lora_name=data.get("lora_name"),
            medium=data.get("medium") or MEDIUM_GPU,
            extra_keys=None if extra is None else tuple(None if k is None else tuple(k) for k in extra),
            cache_salt=data.get("cache_salt"),
            session_id=data.get("session_id"),
        )
    if kind == "BlockRemoved":
        return RemovedRecord(tuple(data["block_hashes"]), data.get("medium") or MEDIUM_GPU)
    if kind == "AllBlocksCleared":
        return ClearedRecord()
    raise ValueError(f"unknown KV event type {kind!r}")


# --------------------------------------------------------------------------- ground truth


class KvGroundTruth:
    """The ordered log of every rank's KV events, as the cache produced them.

    Kept in memory (``events(rank)`` / ``batches(rank)``) and, when ``path`` is
    given, appended to that file as JSON lines, one per batch and flushed at once:
    ``{"rank": r, "seq": s|null, "ts": unix_seconds, "events": [event_to_json(...)]}``.
    ``seq`` is the number the sink gave the batch (``null`` without one; faults in
    the transport never change the log). Read it back with :func:`load_ground_truth`.
    Holds an open file until :meth:`close`; thread-safe.
    """

    def __init__(self, path: str | os.PathLike[str] | None = None, *, keep: bool = True) -> None:
        self._keep = keep
        self._lock = threading.Lock()
        self._batches: dict[int, list[tuple[int | None, tuple[KvEventRecord, ...]]]] = {}
        self._file = open(path, "a", encoding="utf-8") if path is not None else None  # noqa: SIM115

    def record(self, dp_rank: int, seq: int | None, events: Sequence[KvEventRecord]) -> None:
        with self._lock:
            if self._keep:
                self._batches.setdefault(dp_rank, []).append((seq, tuple(events)))
            if self._file is not None:
                line = {
                    "rank": dp_rank,
                    "seq": seq,
                    "ts": time.time(),
                    "events": [event_to_json(e) for e in events],
                }
                self._file.write(json.dumps(line, separators=(",", ":")) + "\n")
                self._file.flush()

    def batches(self, dp_rank: int) -> list[tuple[int | None, tuple[KvEventRecord, ...]]]:
        with self._lock:
            return list(self._batches.get(dp_rank, ()))

    def events(self, dp_rank: int) -> list[KvEventRecord]:
        return [e for _, batch in self.batches(dp_rank) for e in batch]

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def load_ground_truth(path: str | os.PathLike[str]) -> dict[int, list[dict[str, Any]]]:
    """Per rank, the ordered event maps of a ``--kv-log`` file (a torn last line is ignored)."""
    out: dict[int, list[dict[str, Any]]] = {}
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                continue
            out.setdefault(int(entry["rank"]), []).extend(entry["events"])
    return out
