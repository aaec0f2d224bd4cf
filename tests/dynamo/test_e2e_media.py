"""Media through a real Dynamo frontend to aggregated mock engines behind ``run --dynamo``.

The frontend passes each image/video/audio URL (or data URI) through in
``multi_modal_data``; the sidecar must hand every item to the engine, in prompt order, with
its modality, a source the engine advertises and a stable uuid — or refuse the request
with a 4xx naming the modality. Judged from the engine's own record of what it received.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from tests.dynamo.e2e import MODEL, dynamo_sidecar, frontend, require_dynamo, tokenizer_dir
from tests.dynamo.media import chat, image, media_of, png_data_uri, received, request_id, text
from tests.e2e.harness import mock_engine

require_dynamo()
pytestmark = pytest.mark.slow


async def test_an_image_reaches_the_engine(aio_loop: Any, tmp_path: Path) -> None:
    """The issue's reproduction: before, a chat completion with an image answered 200 from an
    engine that never saw the image."""
    tok = tokenizer_dir(tmp_path)
    red, blue = png_data_uri(112, 56), png_data_uri(112, 56, (0, 0, 255))
    with trio.fail_after(120):
        async with (
            mock_engine(tmp_path, "--flavor", "vllm", "--tokenizer-source", str(tok)) as engine,
            dynamo_sidecar(tmp_path, engine.address),
            frontend(tmp_path) as fe,
        ):
            await fe.wait_models(MODEL)
            uuids = []
            for url in (red, red, blue):
                resp = await chat(fe, [text("what is this"), image(url)])
                assert resp.status_code == 200, resp.text
                entry = await received(engine.address, request_id(resp))
                assert media_of(entry) == [("image", "data_uri")], entry
                uuids.append(entry["media"][0]["uuid"])
            assert uuids[0] and uuids[0] == uuids[1] != uuids[2]  # stable per image, distinct across
