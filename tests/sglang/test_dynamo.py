"""Dynamo worker mode over real SGLang: ``run --dynamo`` in front of ``sglang-engine``, Dynamo's real frontend.

The frontend tokenizes with the engine's model directory (the tiny model's tokenizer), SGLang
generates, the sidecar relays: a completion (greedy) carries exactly what the WebSocket plane
gives for the same token ids, streamed or not; a client that leaves mid-stream frees the request
in SGLang with one Abort. File discovery, tcp request plane, zmq event plane
(``tests.dynamo.planes``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.dynamo.e2e import require_dynamo
from tests.real_engines import EngineProc, check_worker_through_dynamo
from tests.sglang.harness import IDLE

require_dynamo()


async def test_sglang_worker_through_dynamo(aio_loop: Any, tmp_path: Path, sglang_engine: EngineProc) -> None:
    await check_worker_through_dynamo(
        sglang_engine,
        tmp_path,
        max_tokens=8,
        long_tokens=3000,
        chat=False,
        idle=IDLE,
        held="sglang_held_requests",
    )
