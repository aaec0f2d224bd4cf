"""The fleet benchmark's anchor worker (``sidecar/bench/dynamo_anchor.py``) does the sidecar's
job for real: through Dynamo's frontend (file discovery, tcp, zmq) it streams the engine's
tokens with the right finish, and a client that disconnects mid-stream makes the engine see
its stream closed and one Abort — so the benchmark compares the sidecar with a worker that
keeps the same cancellation contract, not with one that leaks."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from sidecar.bench.fleet import ANCHOR_READY
from sidecar.bench.pb2 import generate_pb2
from tests.dynamo.e2e import MODEL, dynamo_env, frontend, tokenizer_dir
from tests.e2e.harness import mock_engine, spawn_argv, wait_engine_idle

pytestmark = [pytest.mark.subprocess, pytest.mark.dynamo]


async def test_anchor_streams_and_aborts_on_disconnect(aio_loop: Any, tmp_path: Path) -> None:
    tok = tokenizer_dir(tmp_path)
    pb2 = generate_pb2(tmp_path / "pb2")
    with trio.fail_after(120):
        async with mock_engine(
            tmp_path, "--flavor", "vllm", "--tokenizer-source", str(tok), "--token-delay-ms", "20"
        ) as engine:
            argv = [sys.executable, "-m", "sidecar.bench.dynamo_anchor", "--engine", engine.address]
            argv += ["--pb2-dir", str(pb2), "--model-path", str(tok), "--model-name", "anchored"]
            argv += ["--engine-model", MODEL, "--namespace", "anchor-test"]
            async with (
                spawn_argv(argv, dynamo_env(tmp_path), label="anchor") as anchor,
                frontend(tmp_path) as fe,
            ):
                await anchor.wait_for_line(ANCHOR_READY, timeout=60)
                await fe.wait_models("anchored", timeout=60)
                chunks = await fe.stream(
                    "/v1/completions",
                    {
                        "model": "anchored",
                        "prompt": "hello there",
                        "max_tokens": 12,
                        "ignore_eos": True,
                        "stream_options": {"include_usage": True},
                    },
                )
                assert [c["choices"][0].get("finish_reason") for c in chunks if c["choices"]][-1] == "length"
                assert chunks[-1]["usage"]["completion_tokens"] == 12

                body = {"model": "anchored", "prompt": "a long one", "max_tokens": 2000, "ignore_eos": True}
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
    assert counters["requests_accepted"] == 2
    assert counters["requests_completed"] == 1 and counters["requests_leaked"] == 0
    assert counters["aborts_received"] == 1, counters  # the engine saw one Abort …
    assert counters["requests_aborted"] + counters["orphans_aborted"] == 1  # … and the stream end
