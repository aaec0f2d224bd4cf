"""Every request-plane x event-plane combination Dynamo 1.6 offers, on etcd discovery.

Per combination (tcp or NATS requests; zmq or NATS events; a real etcd, and nats-server
when a plane needs it): the model is listed, a streamed completion carries the engine's
tokens (the same text the WebSocket plane relays for the same token ids), and a client that
disconnects mid-stream makes the engine see its stream closed and exactly one Abort.
The longer checks run on the default planes only (``test_e2e_aggregated.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from tests.dynamo.e2e import MODEL, dynamo_sidecar, encode, frontend, tokenizer_dir, ws_text
from tests.dynamo.planes import PLANE_COMBINATIONS, deployment
from tests.e2e.harness import mock_engine, wait_engine_idle
from tests.reliability.helpers import scrape

pytestmark = [pytest.mark.subprocess, pytest.mark.dynamo]


@pytest.mark.parametrize(("request_plane", "event_plane"), PLANE_COMBINATIONS)
async def test_serves_and_aborts_on_every_plane(
    aio_loop: Any, tmp_path: Path, request_plane: str, event_plane: str
) -> None:
    tok = tokenizer_dir(tmp_path)
    with trio.fail_after(120):
        async with (
            deployment(tmp_path, request_plane, event_plane) as dep,
            mock_engine(
                tmp_path, "--flavor", "vllm", "--tokenizer-source", str(tok), "--token-delay-ms", "20"
            ) as engine,
            dynamo_sidecar(dep, engine.address) as sc,
            frontend(dep) as fe,
        ):
            await fe.wait_models(MODEL)
            prompt = "hello there, bako tu"
            chunks = await fe.stream(
                "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 12, "ignore_eos": True}
            )
            text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
            assert text == await ws_text(sc.ws, encode(tok, prompt), 12), dep.label
            assert [c["choices"][0].get("finish_reason") for c in chunks if c["choices"]][-1] == "length"

            body = {"model": MODEL, "prompt": "a long one", "max_tokens": 2000, "ignore_eos": True}
            async with httpx.AsyncClient(base_url=fe.url, timeout=30) as http:
                async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
                    assert resp.status_code == 200
                    seen = 0
                    async for line in resp.aiter_lines():
                        if line.startswith("data: "):
                            seen += 1
                            if seen == 5:
                                break  # leaving closes the connection mid-stream
            counters = await wait_engine_idle(engine.address, timeout=20)
            assert counters["requests_accepted"] == 3  # the WebSocket one, the streamed one, the cut one
            assert counters["aborts_received"] == 1, counters  # the engine saw one Abort …
            assert counters["requests_leaked"] == 0 and counters["requests_completed"] == 2
            assert counters["requests_aborted"] + counters["orphans_aborted"] == 1  # … and the stream end
            m = await scrape(sc.http)
            assert m.value("openengine_sidecar_dynamo_requests_total", outcome="cancelled") == 1
