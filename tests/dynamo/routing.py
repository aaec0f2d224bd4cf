"""Helpers of the KV-routing tests through Dynamo (mock engines and vLLM alike).

A module of their own so a test module can use them without importing another test module
(which skips at import when the ``dynamo`` extra is missing).
"""

from __future__ import annotations

from typing import Any

from sidecar.client.sidecar_client import open_sidecar
from tests.dynamo.e2e import MODEL


def words(seed: int, n: int) -> str:
    """A distinct prompt of ``n`` two-syllable words (one token each)."""
    syl = [c + v for c in "bcdfghjklmnprstv" for v in "aeiou"]
    return " ".join(syl[(seed * 7 + i * 13) % 80] + syl[(seed * 11 + i * 3) % 80] for i in range(n))


async def warm(ws: str, token_ids: list[int]) -> None:
    """Run ``token_ids`` on one engine directly (its prefix blocks get cached there)."""
    request = {
        "model": MODEL,
        "tokenIds": {"ids": token_ids},
        "stopping": {"maxTokens": 1, "ignoreEos": True},
    }
    async with open_sidecar(ws) as client, client.generate(request) as stream:
        async for _ in stream:
            pass
        assert stream.end is not None and stream.end.outcome == "completed"


async def make_router(cls: Any, endpoint: Any, config: Any) -> Any:
    return cls(endpoint, 16, config)


def scores_of(reply: Any) -> dict[int, int]:
    """{worker id: matched blocks} from ``KvRouter.get_overlap_scores`` (device tier)."""
    out: dict[int, int] = {}
    for row in reply.get("workers", []):
        blocks = row.get("device_blocks", row.get("overlap_blocks", row.get("blocks", 0)))
        if blocks:
            out[int(row["worker_id"])] = int(blocks)
    return out
