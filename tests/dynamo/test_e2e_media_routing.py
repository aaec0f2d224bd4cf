"""Dynamo's KV router routes a repeated image to the engine holding its blocks.

Two mock engines behind ``run --dynamo`` (KV relay on) and a frontend with ``--router-mode
kv``; the tokenizer directory is the vision variant, so Dynamo's frontend builds
media-aware routing information: each image's placeholder becomes, in the routing token
stream, 8 positions holding ``pad_value(mm_hash)`` (``dynamo.common.multimodal.routing_utils``),
``mm_hash`` being its XXH3 hash of the image URL, forwarded to the worker as
``extra_args.mm_hashes``. The sidecar gives the engine that hash as the item's uuid in
Dynamo's KV-event form; the engine's KV events carry it in ``extra_keys`` of the image's
blocks; Dynamo's relay (``image_token_id`` = the engine's ``routing_image_token_id``) turns
the image's placeholder tokens there into the same pad values — so both sides hash the same
blocks.

As in ``test_e2e_kv_routing.py``, each image is cached on a chosen engine *outside Dynamo*
(that sidecar's WebSocket plane), with the uuid the frontend computes (learnt from a probe
model served by a third engine under another component), so Dynamo can only know where it
is from the KV events. Both images come with the SAME text: only the image tells the two
prompts apart, and each repeat must land on the engine holding its image.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from sidecar.client.sidecar_client import open_sidecar
from sidecar.dynamo.tokenizer_dir import write_mock_tokenizer_dir
from sidecar.mock import flavors
from sidecar.mock import tokenizer as tok
from tests.dynamo.e2e import MODEL, dynamo_sidecar, encode, frontend
from tests.dynamo.media import chat, image, png_data_uri, received, request_id, text
from tests.dynamo.planes import deployment
from tests.dynamo.routing import make_router, scores_of, words
from tests.e2e.harness import engine_counters, eventually, mock_engine

pytestmark = [pytest.mark.subprocess, pytest.mark.dynamo]

PROBE = "probe-model"
IMAGE_TOKENS = flavors.MEDIA_TOKENS[flavors.pb.Modality.IMAGE]


def pad_value_for_mm_hash(mm_hash: int) -> int:
    """Dynamo's pad_value scheme (``dynamo.common.multimodal.routing_utils``, which needs torch
    to import): the routing token of every position of an image is 1 000 000 + the hash's low
    30 bits."""
    return 1_000_000 + (mm_hash & ((1 << 30) - 1))


async def warm(ws: str, token_ids: list[int], url: str, uuid: str) -> None:
    """Run the prompt with its image on one engine directly (its blocks get cached there)."""
    request = {
        "model": MODEL,
        "tokenIds": {"ids": token_ids},
        "media": [{"modality": "MODALITY_IMAGE", "dataUri": url, "uuid": uuid}],
        "stopping": {"maxTokens": 1, "ignoreEos": True},
    }
    async with open_sidecar(ws) as client, client.generate(request) as stream:
        async for _ in stream:
            pass
        assert stream.end is not None and stream.end.outcome == "completed"


@pytest.mark.parametrize("flavor", ["trtllm", "vllm", "sglang"])
async def test_a_repeated_image_routes_to_the_engine_holding_its_blocks(
    aio_loop: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flavor: str
) -> None:
    import trio_asyncio
    from dynamo.llm import KvRouter, KvRouterConfig
    from dynamo.runtime import DistributedRuntime

    vision = write_mock_tokenizer_dir(tmp_path / "vision-tokenizer", vision=True)
    engine_args = ["--flavor", flavor, "--tokenizer-source", str(vision)]
    images = [png_data_uri(112, 56, (200, 40, 40)), png_data_uri(112, 56, (40, 40, 200))]
    head, tail = "look", " " + words(3, 60)  # the image in block 0: every block depends on it
    with trio.fail_after(180):
        async with (
            deployment(tmp_path) as dep,
            mock_engine(tmp_path, *engine_args, name="e0") as e0,
            mock_engine(tmp_path, *engine_args, name="e1") as e1,
            mock_engine(tmp_path, *engine_args, "--model", PROBE, name="probe") as probe,
            dynamo_sidecar(dep, e0.address, name="s0") as s0,
            dynamo_sidecar(dep, e1.address, name="s1") as s1,
            dynamo_sidecar(dep, probe.address, "--dynamo-component", "probe", name="sp"),
            frontend(dep, "--router-mode", "kv") as fe,
        ):
            for key, value in dep.env().items():
                monkeypatch.setenv(key, value)  # this process joins the deployment as an observer
            await fe.wait_models(MODEL, PROBE)
            # the sidecar checked, with Dynamo's own resolver, that the frontend fills the engine's token
            assert any("media-aware KV routing on image token 3" in line for line in s0.proc.lines)
            runtime = DistributedRuntime(
                aio_loop, dep.discovery, dep.request_plane, event_plane=dep.event_plane
            )
            try:
                endpoint = runtime.endpoint("dynamo.backend.generate")
                router = await trio_asyncio.aio_as_trio(make_router)(KvRouter, endpoint, KvRouterConfig())

                async def overlap(ids: list[int]) -> dict[int, int]:
                    return scores_of(await trio_asyncio.aio_as_trio(router.get_overlap_scores)(ids))

                engines, sidecars = [e0, e1], [s0, s1]
                token_ids = encode(vision, f"user: {head}<image>{tail}\nassistant:")
                assert token_ids.count(tok.IMAGE_ID) == 1
                routing: list[list[int]] = []
                uuids: list[str] = []
                for target, url in enumerate(images):
                    # the uuid the frontend's request carries: its routing hash, in KV-event form
                    resp = await chat(fe, [text(head), image(url), text(tail)], model=PROBE)
                    assert resp.status_code == 200, resp.text
                    [item] = (await received(probe.address, request_id(resp)))["media"]
                    uuid = item["uuid"]
                    assert len(uuid) == 64 and uuid.endswith("0" * 48), uuid
                    pad = pad_value_for_mm_hash(int(uuid[:16], 16))
                    i = token_ids.index(tok.IMAGE_ID)
                    routing.append(token_ids[:i] + [pad] * IMAGE_TOKENS + token_ids[i + 1 :])
                    uuids.append(uuid)
                    assert not await overlap(routing[target])
                    await warm(sidecars[target].ws, token_ids, url, uuid)

                # engine -> sidecar KV bridge -> Dynamo relay -> event plane: each image's blocks
                # are found on the engine that ran it, and only there (same text on both)
                full = (len(token_ids) + IMAGE_TOKENS - 1) // 16
                owner: list[int] = []
                for target in range(2):

                    async def indexed(ids: list[int] = routing[target]) -> dict[int, int]:
                        return await overlap(ids)

                    scores = await eventually(indexed, 10)
                    assert len(scores) == 1 and min(scores.values()) >= full, scores
                    owner.extend(scores)
                assert owner[0] != owner[1]

                async def served() -> list[int]:
                    return [int((await engine_counters(e.address))["requests_accepted"]) for e in engines]

                for round_ in range(3):  # each image, and its repeats, land on the engine holding it
                    for target, url in enumerate(images):
                        before = await served()
                        resp = await chat(fe, [text(head), image(url), text(tail + f" ba be bi {round_}")])
                        assert resp.status_code == 200, resp.text
                        after = await served()
                        assert [a - b for a, b in zip(after, before, strict=True)] == [
                            int(k == target) for k in range(2)
                        ], f"image {target} cached on engine {target} was routed elsewhere"
                        entry = await received(engines[target].address, request_id(resp))
                        assert [m["uuid"] for m in entry["media"]] == [uuids[target]]
            finally:
                runtime.shutdown()
