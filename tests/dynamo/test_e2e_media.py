"""Media through a real Dynamo frontend to aggregated mock engines behind ``run --dynamo``.

The frontend passes each image/video/audio URL (or data URI) through in
``multi_modal_data``; the sidecar must hand every item to the engine, in prompt order, with
its modality, a source the engine advertises and a stable uuid — or refuse the request
with a 4xx naming the modality. Judged from the engine's own record of what it received.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
import trio

from tests.dynamo.e2e import (
    MODEL,
    Deployment,
    Frontend,
    dynamo_sidecar,
    frontend,
    tokenizer_dir,
)
from tests.dynamo.media import (
    audio,
    chat,
    image,
    media_of,
    png_data_uri,
    received,
    request_id,
    text,
    video,
)
from tests.e2e.harness import mock_engine, wait_engine_idle

pytestmark = [pytest.mark.subprocess, pytest.mark.dynamo]


async def test_an_image_reaches_the_engine(
    aio_loop: Any, tmp_path: Path, etcd_deployment: Deployment
) -> None:
    """The issue's reproduction: before, a chat completion with an image answered 200 from an
    engine that never saw the image."""
    tok = tokenizer_dir(tmp_path)
    red, blue = png_data_uri(112, 56), png_data_uri(112, 56, (0, 0, 255))
    with trio.fail_after(120):
        async with (
            mock_engine(tmp_path, "--flavor", "vllm", "--tokenizer-source", str(tok)) as engine,
            dynamo_sidecar(etcd_deployment, engine.address) as sc,
            frontend(etcd_deployment) as fe,
        ):
            await fe.wait_models(MODEL)
            log = "\n".join(sc.proc.lines)
            assert "media: image (URL pass-through; sources url, data_uri)" in log
            assert "images route by their text prefix" in log  # not a model Dynamo counts images for
            uuids = []
            for url in (red, red, blue):
                resp = await chat(fe, [text("what is this"), image(url)])
                assert resp.status_code == 200, resp.text
                entry = await received(engine.address, request_id(resp))
                assert media_of(entry) == [("image", "data_uri")], entry
                uuids.append(entry["media"][0]["uuid"])
            assert uuids[0] and uuids[0] == uuids[1] != uuids[2]  # stable per image, distinct across


#: What each flavour's card accepts on the aggregated path (sidecar/mock/flavors.py).
ACCEPTS = {
    "trtllm": {"image", "video", "audio"},
    "vllm": {"image"},
    "sglang": {"image", "video", "audio"},
}


def sha(url: str) -> str:
    return "sha256:" + hashlib.sha256(url.encode()).hexdigest()


async def refused(fe: Frontend, content: list[dict[str, Any]], *words: str, **body: Any) -> None:
    resp = await chat(fe, content, **body)
    assert resp.status_code == 400, resp.text
    message = resp.json()["message"]
    assert all(w in message for w in words), message


@pytest.mark.parametrize("flavor", ["trtllm", "vllm", "sglang"])
async def test_each_modality_served_or_refused_as_the_card_says(
    aio_loop: Any, tmp_path: Path, etcd_deployment: Deployment, flavor: str
) -> None:
    tok = tokenizer_dir(tmp_path)
    accepts = ACCEPTS[flavor]
    red, blue = png_data_uri(112, 56), png_data_uri(56, 56, (0, 0, 255))
    with trio.fail_after(120):
        async with (
            mock_engine(tmp_path, "--flavor", flavor, "--tokenizer-source", str(tok)) as engine,
            dynamo_sidecar(etcd_deployment, engine.address),
            frontend(etcd_deployment) as fe,
        ):
            await fe.wait_models(MODEL)
            served = 0
            for modality, part, source in (
                ("image", image(red), "data_uri"),
                ("video", video(), "url"),
                ("audio", audio(), "data_uri"),
            ):
                if modality in accepts:
                    resp = await chat(fe, [text("what is it"), part])
                    assert resp.status_code == 200, resp.text
                    entry = await received(engine.address, request_id(resp))
                    assert media_of(entry) == [(modality, source)]
                    served += 1
                else:  # refused by the sidecar, before the engine, naming the modality
                    await refused(fe, [text("what is it"), part], modality, "not accepted")

            # several items: the engine gets them in prompt order (it checks them against the
            # placeholders the chat template put in the prompt), each with its uuid
            parts = [image(red), image(blue)]
            if accepts >= {"video", "audio"}:
                parts = [video(), image(red), audio(), image(blue)]
            resp = await chat(fe, [text("compare"), parts[0], text("with"), *parts[1:]])
            assert resp.status_code == 200, resp.text
            entry = await received(engine.address, request_id(resp))
            urls = [p[p["type"]]["url"] for p in parts]
            assert [m["uuid"] for m in entry["media"]] == [sha(u) for u in urls]
            assert [m for m, _ in media_of(entry)] == [p["type"].removesuffix("_url") for p in parts]
            served += 1

            # per-request media options: only where the card supports them
            if flavor == "vllm":
                resp = await chat(fe, [image(red)], mm_processor_kwargs={"max_pixels": 1000})
                assert resp.status_code == 200, resp.text
                entry = await received(engine.address, request_id(resp))
                assert entry["media_options"] == {"image": {"max_pixels": 1000}}
                served += 1
            else:
                await refused(fe, [image(red)], "media_options", mm_processor_kwargs={"max_pixels": 1000})

            counters = await wait_engine_idle(engine.address)
            assert counters["requests_rejected"] == 0  # every refusal happened before the engine
            assert counters["requests_completed"] == counters["requests_accepted"] == served

            if "audio" in accepts:
                # Dynamo 1.6.1's frontend keeps no multi_modal_data for an `input_audio` part (only
                # image_url / video_url / audio_url); its placeholder reaches the engine alone,
                # and the engine refuses the orphan placeholder (docs/DYNAMO.md)
                inline = {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}
                await refused(fe, [text("hear"), inline], "placeholder", "no media items")


async def test_media_to_a_text_only_engine_is_refused(
    aio_loop: Any, tmp_path: Path, etcd_deployment: Deployment
) -> None:
    tok = tokenizer_dir(tmp_path)
    with trio.fail_after(120):
        async with (
            mock_engine(
                tmp_path, "--flavor", "sglang", "--text-only", "--tokenizer-source", str(tok)
            ) as engine,
            dynamo_sidecar(etcd_deployment, engine.address),
            frontend(etcd_deployment) as fe,
        ):
            await fe.wait_models(MODEL)
            await refused(
                fe, [text("what is it"), image(png_data_uri(56, 56))], "does not accept media (image)"
            )
            await refused(fe, [video()], "does not accept media (video)")
            assert (await chat(fe, [text("just text")])).status_code == 200
            counters = await wait_engine_idle(engine.address)
            assert counters["requests_rejected"] == 0 and counters["requests_accepted"] == 1
