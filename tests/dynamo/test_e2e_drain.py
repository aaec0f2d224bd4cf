"""SIGTERM during load: the sidecar leaves Dynamo's discovery first, then drains; nothing is lost.

Two aggregated workers behind one frontend. While streams run on both, worker A gets
SIGTERM: it unregisters (Dynamo stops routing new requests to it), waits the grace, then
drains — its admitted streams run to completion — and exits 0. Requests sent meanwhile are
served by worker B. Judged from the client (every response complete) and from engine A
(every accepted request completed, no Abort).
"""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path
from typing import Any

import pytest
import trio

from tests.dynamo.e2e import MODEL, Deployment, dynamo_sidecar, frontend, tokenizer_dir
from tests.e2e.harness import engine_counters, mock_engine, wait_engine_idle

pytestmark = [pytest.mark.subprocess, pytest.mark.dynamo]

TOKENS = 40


async def test_sigterm_during_load_loses_no_request(
    aio_loop: Any, tmp_path: Path, etcd_deployment: Deployment
) -> None:
    tok = tokenizer_dir(tmp_path)
    common = ["--flavor", "vllm", "--tokenizer-source", str(tok), "--token-delay-ms", "25"]
    with trio.fail_after(150):
        async with (
            mock_engine(tmp_path, *common, name="ea") as ea,
            mock_engine(tmp_path, *common, name="eb") as eb,
            dynamo_sidecar(etcd_deployment, ea.address, "--drain-timeout", "20", name="sa") as sa,
            dynamo_sidecar(etcd_deployment, eb.address, name="sb"),
            frontend(etcd_deployment) as fe,
        ):
            await fe.wait_models(MODEL)
            results: list[tuple[str, str, int]] = []
            started = trio.Semaphore(0)

            async def one(tag: str) -> None:
                body = {"model": MODEL, "prompt": f"load {tag}", "max_tokens": TOKENS, "ignore_eos": True}
                text, finish, n, first = "", "", 0, True
                async with fe.http.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
                    assert resp.status_code == 200, (tag, await resp.aread())
                    async for line in resp.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        if first:
                            started.release()
                            first = False
                        chunk = json.loads(line[6:])
                        for choice in chunk.get("choices") or []:
                            text += choice.get("text") or ""
                            finish = choice.get("finish_reason") or finish
                        if chunk.get("usage"):
                            n = chunk["usage"]["completion_tokens"]
                results.append((tag, finish, n))

            async with trio.open_nursery() as nursery:
                for i in range(12):
                    nursery.start_soon(one, f"before-{i}")
                for _ in range(12):
                    await started.acquire()
                accepted_a = (await engine_counters(ea.address))["requests_accepted"]
                assert accepted_a >= 1  # A is busy when the signal arrives
                sa.proc.signal(signal.SIGTERM)
                await sa.proc.wait_for_line(re.compile("Dynamo: left"))
                for i in range(12):  # new work during A's drain
                    nursery.start_soon(one, f"during-{i}")
                    await trio.sleep(0.05)  # spread over the drain (load shape, not synchronization)
            assert len(results) == 24
            assert all(finish == "length" for _, finish, _ in results), results
            assert await sa.proc.wait(timeout=30) == 0
            assert any("drained" in line for line in sa.proc.lines)
            a = await wait_engine_idle(ea.address)
            b = await wait_engine_idle(eb.address)
            assert a["requests_accepted"] == accepted_a  # nothing new reached A after it left
            assert a["requests_completed"] == a["requests_accepted"] and a["aborts_received"] == 0, a
            assert b["requests_completed"] == 24 - accepted_a and b["aborts_received"] == 0, b
