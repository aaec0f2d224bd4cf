"""Random KV events in the bridge's expected output form (plain dicts), for fakes and checks."""

from __future__ import annotations

import random
from typing import Any

MEDIA = ["GPU", "CPU_PINNED", "DISK", "EXTERNAL", None]


def rand_hash(rng: random.Random, kind: str) -> int | bytes:
    if kind == "bytes":
        return rng.randbytes(rng.choice([8, 16, 32]))
    # bias towards the edges of the unsigned 64-bit range
    return rng.choice([rng.getrandbits(64), (1 << 64) - 1, 1 << 63, rng.getrandbits(63), 0])


def stored(
    rng: random.Random, *, hash_kind: str = "int", style: str = "vllm-map", proto: bool = False
) -> dict[str, Any]:
    n = rng.randint(1, 3)
    bs = rng.choice([1, 4, 16])
    ev: dict[str, Any] = {
        "type": "BlockStored",
        "block_hashes": [rand_hash(rng, hash_kind) for _ in range(n)],
        "parent_block_hash": rand_hash(rng, hash_kind) if rng.random() < 0.7 else None,
        "token_ids": [rng.randrange(0, 1 << 32) for _ in range(n * bs)],
        "block_size": bs,
        "lora_id": rng.randint(1, 9) if rng.random() < 0.2 else None,
        "medium": rng.choice(MEDIA),
        "lora_name": None,
    }
    if ev["lora_id"] is not None:
        ev["lora_name"] = f"adapter-{ev['lora_id']}"
    if not style.endswith("array") or rng.random() < 0.5:  # arrays: optional fields only sometimes
        if rng.random() < 0.3:
            ev["extra_keys"] = [
                [f"mm:{rng.getrandbits(32):08x}", str(rng.randint(0, 99)) if proto else rng.randint(0, 99)]
                if rng.random() < 0.6
                else None
                for _ in range(n)
            ]
        if rng.random() < 0.2:
            ev["group_idx"] = rng.randint(1, 3)
        if rng.random() < 0.2:
            ev["kv_cache_spec_kind"] = "sliding_window"
            ev["kv_cache_spec_sliding_window"] = 4096
    if style.startswith("sglang") and ev["lora_name"] is None and rng.random() < 0.3:
        ev["metadata"] = {"cache_salt": f"salt{rng.randint(0, 9)}", "session_id": f"s{rng.randint(0, 99)}"}
    return ev


def removed(rng: random.Random, *, hash_kind: str = "int", style: str = "vllm-map") -> dict[str, Any]:
    ev: dict[str, Any] = {
        "type": "BlockRemoved",
        "block_hashes": [rand_hash(rng, hash_kind) for _ in range(rng.randint(1, 3))],
        "medium": rng.choice(MEDIA),
    }
    if rng.random() < 0.2:
        ev["group_idx"] = rng.randint(1, 3)
    return ev


def event(
    rng: random.Random,
    *,
    hash_kind: str = "int",
    style: str = "vllm-map",
    clears: bool = True,
    proto: bool = False,
) -> dict[str, Any]:
    r = rng.random()
    if clears and r < 0.03:
        return {"type": "AllBlocksCleared"}
    if r < 0.7:
        return stored(rng, hash_kind=hash_kind, style=style, proto=proto)
    return removed(rng, hash_kind=hash_kind, style=style)


def batch(rng: random.Random, n: int = 16, **kw: Any) -> list[dict[str, Any]]:
    return [event(rng, **kw) for _ in range(n)]


CLEARED = {"type": "AllBlocksCleared"}
