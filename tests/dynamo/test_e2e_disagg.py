"""Prefill/decode through Dynamo's own disaggregation flow (vLLM-flavour mock pair).

The prefill sidecar registers as a prefill worker, the decode sidecar as a decode worker
that needs one. Dynamo's frontend sends each request to the prefill worker first; its
``PrefillReady`` comes back as ``disaggregated_params`` carrying the engine's
``KvSessionRef`` bytes (opaque to Dynamo); the frontend forwards them to the decode worker,
whose sidecar hands them to the decode engine unchanged; the decode engine pulls the KV
from the prefill engine and generates.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from tests.dynamo.e2e import MODEL, Deployment, dynamo_sidecar, frontend, tokenizer_dir
from tests.e2e.harness import mock_engine, wait_engine_idle

pytestmark = [pytest.mark.subprocess, pytest.mark.dynamo]


@pytest.mark.parametrize("flavor", ["vllm", "sglang"])
async def test_prefill_decode_pair_serves_through_dynamo(
    aio_loop: Any, tmp_path: Path, etcd_deployment: Deployment, flavor: str
) -> None:
    """vLLM: context-first handoff (the prefill's KvSessionRef bytes travel in
    ``disaggregated_params``); SGLang: client bootstrap (the prefill sidecar registers the
    engine's bootstrap endpoint; Dynamo's ``bootstrap_info`` reaches both sides)."""
    tok = tokenizer_dir(tmp_path)
    common = ["--flavor", flavor, "--tokenizer-source", str(tok)]
    with trio.fail_after(150):
        async with (
            mock_engine(tmp_path, *common, "--role", "prefill", name="prefill") as prefill,
            mock_engine(tmp_path, *common, "--role", "decode", name="decode") as decode,
            dynamo_sidecar(etcd_deployment, prefill.address, name="sp") as sp,
            dynamo_sidecar(etcd_deployment, decode.address, name="sd") as sd,
            frontend(etcd_deployment) as fe,
        ):
            assert sp.bound["dynamo"] == "dynamo.prefill.generate"
            assert sd.bound["dynamo"] == "dynamo.backend.generate"
            await fe.wait_models(MODEL)
            await fe.wait_prefill_activated()
            texts = []
            for i in range(3):
                body = await fe.complete(f"tell me {i} things", max_tokens=10, ignore_eos=True)
                choice = body["choices"][0]
                assert choice["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 10
                texts.append(choice["text"])
            chunks = await fe.stream(
                "/v1/chat/completions",
                {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 8,
                    "ignore_eos": True,
                },
            )
            streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
            assert len(streamed) > 8
            p = await wait_engine_idle(prefill.address)
            d = await wait_engine_idle(decode.address)
            # every request went through both engines: prefill ended with PrefillReady, decode pulled
            assert p["requests_accepted"] == p["requests_completed"] == 4, p
            assert d["requests_accepted"] == d["requests_completed"] == 4, d
            assert p["aborts_received"] == 0 and d["aborts_received"] == 0
            assert p["kv_sessions_open"] == 0  # every handed-off session was pulled and released
            assert all(t.strip() for t in texts) and len(set(texts)) == 3
