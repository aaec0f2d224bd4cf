"""End to end through a real Dynamo frontend: an aggregated mock engine behind ``run --dynamo``.

One deployment per test (frontend + sidecar + engine take seconds to start), several checks
per test: /v1/models, completions and chat (streaming and not) carry the engine's tokens —
the same text the sidecar's WebSocket plane relays for the same token ids. On etcd discovery,
the tcp request plane and the zmq event plane; every plane combination, and a client that
disconnects mid-stream, in ``test_e2e_planes.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from tests.dynamo.e2e import (
    MODEL,
    Deployment,
    dynamo_sidecar,
    encode,
    frontend,
    tokenizer_dir,
    ws_text,
)
from tests.e2e.harness import mock_engine, wait_engine_idle

pytestmark = [pytest.mark.subprocess, pytest.mark.dynamo]


async def test_aggregated_worker_through_dynamo(
    aio_loop: Any, tmp_path: Path, etcd_deployment: Deployment
) -> None:
    tok = tokenizer_dir(tmp_path)
    with trio.fail_after(120):
        async with (
            mock_engine(
                tmp_path, "--flavor", "vllm", "--tokenizer-source", str(tok), "--alias", "mock-alias"
            ) as engine,
            dynamo_sidecar(etcd_deployment, engine.address) as sc,
            frontend(etcd_deployment) as fe,
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
