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

import trio

from sidecar.client.sidecar_client import open_sidecar
from tests.dynamo.e2e import dynamo_sidecar, encode, frontend, require_dynamo
from tests.e2e.harness import eventually
from tests.sglang.harness import MODEL, attributes, wait_request_gone
from tests.vllm.harness import EngineProc

require_dynamo()


async def ws_ids(ws: str, ids: list[int], max_tokens: int) -> list[int]:
    """The token ids SGLang generates greedily for ``ids``, through the sidecar's WebSocket plane."""
    request = {
        "model": MODEL,
        "tokenIds": {"ids": ids},
        "sampling": {"temperature": 0.0},
        "stopping": {"maxTokens": max_tokens, "ignoreEos": True},
    }
    async with open_sidecar(ws) as client, client.generate(request) as stream:
        out = [
            t.token_id async for e in stream if e.response.token is not None for t in e.response.token.tokens
        ]
    assert stream.end is not None and stream.end.outcome == "completed", stream.end
    return out


def decode(model: Path, ids: list[int]) -> str:
    """``ids`` detokenized at once, as Dynamo's frontend does."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(model / "tokenizer.json")).decode(ids)  # type: ignore[no-any-return]


async def test_sglang_worker_through_dynamo(aio_loop: Any, tmp_path: Path, sglang_engine: EngineProc) -> None:
    tok = sglang_engine.model
    greedy = {"max_tokens": 8, "ignore_eos": True, "temperature": 0.0}
    with trio.fail_after(180):
        async with dynamo_sidecar(tmp_path, sglang_engine.address) as sc, frontend(tmp_path) as fe:
            await fe.wait_models(MODEL, timeout=60)
            prompt = "Bakeno dafi, and the bakeno is"
            resp = await fe.http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, **greedy})
            assert resp.status_code == 200, resp.text
            body = resp.json()
            choice = body["choices"][0]
            assert choice["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 8
            assert choice["text"] == decode(tok, await ws_ids(sc.ws, encode(tok, prompt), 8))

            chunks = await fe.stream("/v1/completions", {"model": MODEL, "prompt": prompt, **greedy})
            assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == choice["text"]

            # a client that leaves mid-stream: Dynamo stops the request context, the sidecar aborts
            before = (await attributes(sglang_engine.address))["aborts_received"]
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 3000, "ignore_eos": True, "stream": True}
            async with fe.http.stream("POST", "/v1/completions", json=body) as stream:
                assert stream.status_code == 200
                seen = 0
                async for line in stream.aiter_lines():
                    seen += line.startswith("data: ")
                    if seen == 3:
                        break
            await wait_request_gone(sglang_engine.address)

            async def aborted() -> bool:
                return (await attributes(sglang_engine.address))["aborts_received"] == before + 1

            await eventually(aborted, 10)
        attrs = await attributes(sglang_engine.address)  # the sidecar has exited: no Abort still due
    assert attrs["aborts_received"] == before + 1 and attrs["sglang_held_requests"] == 0
