"""Media through Dynamo's prefill → decode flow: a mock P/D pair per flavour behind the frontend.

The frontend sends the request (with its ``multi_modal_data``) to the prefill worker, then
to the decode worker with the prefill's handoff (SGLang-style: both at once with one
bootstrap room). Both engines must receive the same media items with the same uuids — the
decode engine rebuilds the prompt's blocks from them — for every modality the flavour's
card allows on the prefill/decode path (image and video on TensorRT-LLM and SGLang, image
on vLLM); any other (audio everywhere) is refused with a 400 naming it, before either engine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from tests.dynamo.e2e import MODEL, Deployment, dynamo_sidecar, frontend, tokenizer_dir
from tests.dynamo.media import audio, chat, image, png_data_uri, text, video
from tests.e2e.harness import engine_counters, mock_engine, wait_engine_idle

pytestmark = [pytest.mark.subprocess, pytest.mark.dynamo]

PD_ACCEPTS = {"trtllm": {"image", "video"}, "vllm": {"image"}, "sglang": {"image", "video"}}


@pytest.mark.parametrize("flavor", ["trtllm", "vllm", "sglang"])
async def test_media_through_prefill_and_decode(
    aio_loop: Any, tmp_path: Path, etcd_deployment: Deployment, flavor: str
) -> None:
    tok = tokenizer_dir(tmp_path)
    common = ["--flavor", flavor, "--tokenizer-source", str(tok)]
    with trio.fail_after(150):
        async with (
            mock_engine(tmp_path, *common, "--role", "prefill", name="prefill") as prefill,
            mock_engine(tmp_path, *common, "--role", "decode", name="decode") as decode,
            dynamo_sidecar(etcd_deployment, prefill.address, name="sp"),
            dynamo_sidecar(etcd_deployment, decode.address, name="sd"),
            frontend(etcd_deployment) as fe,
        ):
            await fe.wait_models(MODEL)
            await fe.wait_prefill_activated()
            seen: dict[str, set[str]] = {prefill.address: set(), decode.address: set()}

            async def new_record(address: str) -> dict[str, Any]:
                """The one request ``address`` accepted since the last call."""
                recent = (await engine_counters(address))["recent_requests"]
                fresh = set(recent) - seen[address]
                assert len(fresh) == 1, (address, fresh)
                seen[address] |= fresh
                entry: dict[str, Any] = recent[fresh.pop()]
                return entry

            served = 0
            for modality, part in (
                ("image", image(png_data_uri(112, 56))),
                ("video", video()),
                ("audio", audio()),
            ):
                resp = await chat(fe, [text("what is it"), part], max_tokens=4, ignore_eos=True)
                if modality in PD_ACCEPTS[flavor]:
                    assert resp.status_code == 200, resp.text
                    assert resp.json()["usage"]["completion_tokens"] == 4
                    p, d = await new_record(prefill.address), await new_record(decode.address)
                    assert [m["modality"] for m in p["media"]] == [f"MODALITY_{modality.upper()}"]
                    assert p["media"] == d["media"] and p["media"][0]["uuid"]  # same items, same uuid
                    served += 1
                else:
                    assert resp.status_code == 400, resp.text
                    message = resp.json()["message"]
                    assert f"{modality} is not accepted on the prefill/decode path" in message, message
            p_counters = await wait_engine_idle(prefill.address)
            d_counters = await wait_engine_idle(decode.address)
            for c in (p_counters, d_counters):
                assert c["requests_rejected"] == 0, c  # refusals happened before either engine
                assert c["requests_accepted"] == c["requests_completed"] == served, c
            assert p_counters["kv_sessions_open"] == 0
