"""Benchmark (not a test): the same load through a real Dynamo frontend to two backends.

(a) ``openengine-sidecar run --dynamo`` in front of ``mock-engine --fast`` (vLLM flavour);
(b) Dynamo's own ``python -m dynamo.mocker`` (``--speedup-ratio`` high: no simulated delays),

both registered with the same mock-vocabulary tokenizer directory, on file discovery / tcp
request plane / zmq event plane, everything on loopback. The client streams completions
(``max_tokens`` tokens each, ``ignore_eos``) at a fixed concurrency and reports output
tokens/s, requests/s and time to first token (first streamed chunk) percentiles.

    .venv/bin/python -m tests.dynamo.bench_frontend [--requests 256] [--concurrency 16] [--tokens 64]

Needs the 'dynamo' extra (scripts/install-dynamo). Bounded: every phase has a deadline.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import trio

from tests.dynamo.e2e import MODEL, Frontend, dynamo_env, dynamo_sidecar, frontend, spawn_argv, tokenizer_dir
from tests.e2e.harness import mock_engine


@asynccontextmanager
async def sidecar_backend(tmp: Path, tok: Path) -> AsyncIterator[None]:
    async with (
        mock_engine(
            tmp, "--flavor", "vllm", "--fast", "--tokenizer-source", str(tok), "--max-running", "256"
        ) as e,
        dynamo_sidecar(tmp, e.address, "--no-kv-events"),
    ):
        yield


@asynccontextmanager
async def mocker_backend(tmp: Path, tok: Path) -> AsyncIterator[None]:
    argv = [
        sys.executable,
        "-m",
        "dynamo.mocker",
        "--model-path",
        str(tok),
        "--model-name",
        MODEL,
        "--speedup-ratio",
        "10000",
        "--max-num-seqs",
        "256",
        "--block-size",
        "16",
    ]
    async with spawn_argv(argv, dynamo_env(tmp)):
        yield


async def run_load(fe: Frontend, requests: int, concurrency: int, tokens: int) -> dict[str, Any]:
    ttft: list[float] = []
    out_tokens = 0
    errors = 0
    prompt = " ".join(["bako tu rive"] * 20)  # 60 prompt tokens

    async def one(i: int) -> None:
        nonlocal out_tokens, errors
        body = {
            "model": MODEL,
            "prompt": f"{i} {prompt}",
            "max_tokens": tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        t0 = time.perf_counter()
        first = None
        async with fe.http.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                errors += 1
                await resp.aread()
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if first is None and chunk.get("choices"):
                    first = time.perf_counter() - t0
                if chunk.get("usage"):
                    out_tokens += chunk["usage"]["completion_tokens"]
        if first is not None:
            ttft.append(first)

    limiter = trio.Semaphore(concurrency)

    async def gated(i: int) -> None:
        async with limiter:
            await one(i)

    t0 = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for i in range(requests):
            nursery.start_soon(gated, i)
    wall = time.perf_counter() - t0
    ttft.sort()
    return {
        "requests": requests,
        "errors": errors,
        "wall_s": round(wall, 2),
        "req_per_s": round(requests / wall, 1),
        "out_tok_per_s": round(out_tokens / wall),
        "out_tokens": out_tokens,
        "ttft_p50_ms": round(statistics.median(ttft) * 1000, 1) if ttft else None,
        "ttft_p90_ms": round(ttft[int(len(ttft) * 0.9) - 1] * 1000, 1) if ttft else None,
    }


async def bench(backend: str, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        tok = tokenizer_dir(tmp)
        make = sidecar_backend if backend == "sidecar" else mocker_backend
        with trio.fail_after(600):
            async with make(tmp, tok), frontend(tmp) as fe:
                await fe.wait_models(MODEL, timeout=60)
                fe.http.timeout = httpx.Timeout(120)
                await run_load(fe, 16, 8, 8)  # warm-up
                return await run_load(fe, args.requests, args.concurrency, args.tokens)


async def main(args: argparse.Namespace) -> None:
    import trio_asyncio

    async with trio_asyncio.open_loop():
        results = {name: await bench(name, args) for name in ("sidecar", "mocker")}
    print(json.dumps({"load": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    trio.run(main, parser.parse_args())
