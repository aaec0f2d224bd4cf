"""End to end through a real Dynamo frontend: an aggregated mock engine behind ``run --dynamo``.

One deployment per test (frontend + sidecar + engine take seconds to start), several checks
per test: /v1/models, completions and chat (streaming and not) carry the engine's tokens —
the same text the sidecar's WebSocket plane relays for the same token ids — and a client
that disconnects mid-stream makes the engine see its stream closed and an Abort.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from tests.dynamo.e2e import MODEL, dynamo_sidecar, encode, frontend, require_dynamo, tokenizer_dir, ws_text
from tests.e2e.harness import mock_engine, wait_engine_idle

require_dynamo()
pytestmark = pytest.mark.slow


async def test_aggregated_worker_through_dynamo(aio_loop: Any, tmp_path: Path) -> None:
    tok = tokenizer_dir(tmp_path)
    with trio.fail_after(120):
        async with (
            mock_engine(
                tmp_path, "--flavor", "vllm", "--tokenizer-source", str(tok), "--alias", "mock-alias"
            ) as engine,
            dynamo_sidecar(tmp_path, engine.address) as sc,
            frontend(tmp_path) as fe,
        ):
            assert sc.bound["dynamo"] == "dynamo.backend.generate"
            await fe.wait_models(MODEL, "mock-alias")

            # completions, not streaming: the engine's tokens, detokenized by Dynamo
            prompt = "hello there, bako tu"
            body = await fe.complete(prompt, max_tokens=12, ignore_eos=True)
            choice = body["choices"][0]
            assert choice["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 12
            assert choice["text"] == await ws_text(sc.ws, encode(tok, prompt), 12)
            assert (await fe.complete(prompt, max_tokens=12, ignore_eos=True))["choices"][0][
                "text"
            ] == choice["text"]  # deterministic

            # completions, streaming
            chunks = await fe.stream(
                "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 12, "ignore_eos": True}
            )
            assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == choice["text"]
            assert [c["choices"][0].get("finish_reason") for c in chunks if c["choices"]][-1] == "length"

            # chat, both ways, through the alias
            messages = [{"role": "user", "content": "hi"}]
            resp = await fe.http.post(
                "/v1/chat/completions",
                json={"model": "mock-alias", "messages": messages, "max_tokens": 9, "ignore_eos": True},
            )
            assert resp.status_code == 200, resp.text
            chat = resp.json()["choices"][0]
            chat_ids = encode(tok, "user: hi\nassistant:")
            expected = await ws_text(sc.ws, chat_ids, 9)
            assert chat["message"]["content"] == expected and chat["finish_reason"] == "length"
            chunks = await fe.stream(
                "/v1/chat/completions",
                {"model": MODEL, "messages": messages, "max_tokens": 9, "ignore_eos": True},
            )
            streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
            assert streamed == expected

            # natural end (EOS) and a stop string
            natural = await fe.complete(prompt, max_tokens=200)
            assert natural["choices"][0]["finish_reason"] == "stop"
            counters = await wait_engine_idle(engine.address)
            assert counters["aborts_received"] == 0, counters  # completed streams are never aborted
            assert counters["requests_completed"] == counters["requests_accepted"]


async def test_client_disconnect_aborts_on_the_engine(aio_loop: Any, tmp_path: Path) -> None:
    tok = tokenizer_dir(tmp_path)
    with trio.fail_after(120):
        async with (
            mock_engine(
                tmp_path, "--flavor", "vllm", "--tokenizer-source", str(tok), "--token-delay-ms", "20"
            ) as engine,
            dynamo_sidecar(tmp_path, engine.address) as sc,
            frontend(tmp_path) as fe,
        ):
            await fe.wait_models(MODEL)
            body = {
                "model": MODEL,
                "prompt": "a long one",
                "max_tokens": 2000,
                "ignore_eos": True,
                "stream": True,
            }
            async with httpx.AsyncClient(base_url=fe.url, timeout=30) as http:
                async with http.stream("POST", "/v1/completions", json=body) as resp:
                    assert resp.status_code == 200
                    seen = 0
                    async for line in resp.aiter_lines():
                        if line.startswith("data: "):
                            seen += 1
                            if seen == 5:
                                break  # leaving closes the connection mid-stream
            counters = await wait_engine_idle(engine.address, timeout=20)
            assert counters["requests_accepted"] == 1
            assert counters["aborts_received"] == 1, counters  # the engine saw the Abort …
            assert counters["requests_leaked"] == 0 and counters["requests_completed"] == 0
            assert counters["requests_aborted"] + counters["orphans_aborted"] == 1  # … and the stream end
            async with httpx.AsyncClient() as http:
                sidecar_metrics = (await http.get(sc.http + "/metrics")).text
            assert 'openengine_sidecar_dynamo_requests_total{outcome="cancelled"} 1.0' in sidecar_metrics
