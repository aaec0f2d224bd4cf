"""Dynamo's multi_modal_data → GenerateRequest.media, then admission (no Dynamo needed).

Request shapes are the ones Dynamo 1.6.1's frontend sends (captured from it): one
``{"Url": …}`` list per modality, the messages in ``extra_args`` with data URIs blanked, and
``extra_args.mm_hashes`` when it built media-aware routing info.
"""

from __future__ import annotations

import base64
import hashlib
from typing import Any

import pytest

from sidecar.core.admission import admit
from sidecar.core.card import MultimodalCard
from sidecar.core.errors import Rejection
from sidecar.dynamo.mapping import to_generate_request
from sidecar.dynamo.media import MAX_MEDIA_ITEMS, media_request, routing_uuid
from sidecar.openengine import pb
from tests.dynamo.helpers import mock_card
from tests.dynamo.test_mapping import dynamo_request

M = pb.Modality
PNG = "data:image/png;base64," + base64.b64encode(b"\x89PNG fake").decode()
VIDEO = "http://127.0.0.1:9/clip.mp4"
AUDIO = "data:audio/wav;base64,UklGRg=="
MM = MultimodalCard(
    aggregate_modalities=["image", "video", "audio"],
    prefill_decode_modalities=["image", "video"],
    source_types=["url", "data_uri"],
    supports_per_request_media_options=True,
    routing_image_token_id=3,
)


def part(kind: str) -> dict[str, Any]:
    return {"type": kind, kind: {"url": "", "detail": None}}


def with_media(*parts: tuple[str, str], messages: bool = True, **extra: Any) -> dict[str, Any]:
    """A Dynamo request carrying ``parts`` ((multi_modal_data key, URL), in prompt order)."""
    data: dict[str, list[dict[str, str]]] = {}
    for key, url in parts:
        data.setdefault(key, []).append({"Url": url})
    extra_args: dict[str, Any] = dict(extra)
    if messages:
        content = [{"type": "text", "text": "look"}, *(part(key) for key, _ in parts)]
        extra_args["messages"] = [
            {"role": "system", "content": [part("image_url")]},  # the frontend ignores system parts
            {"role": "user", "content": content},
        ]
    return dynamo_request(multi_modal_data=data, extra_args=extra_args)


def sha(url: str) -> str:
    return "sha256:" + hashlib.sha256(url.encode()).hexdigest()


def summary(items: list[pb.MediaItem]) -> list[tuple[str, str]]:
    import betterproto2

    return [(M(i.modality).name.lower(), betterproto2.which_one_of(i, "source")[0] or "") for i in items]


def test_items_in_prompt_order_across_modalities() -> None:
    # the map groups by modality; the messages give the order the placeholders have
    req = with_media(("video_url", VIDEO), ("image_url", PNG), ("audio_url", AUDIO), ("image_url", VIDEO))
    items, options = media_request(req, MM)
    assert summary(items) == [
        ("video", "url"),
        ("image", "data_uri"),
        ("audio", "data_uri"),
        ("image", "url"),
    ]
    assert [i.uuid for i in items] == [sha(VIDEO), sha(PNG), sha(AUDIO), sha(VIDEO)]
    assert items[1].data_uri == PNG and options is None


def test_routing_hashes_become_dynamo_kv_event_uuids() -> None:
    req = with_media(
        ("image_url", PNG), ("image_url", VIDEO), mm_hashes=["c78e1c105eaf0524", "AB112B8DAA5DBB8C"]
    )
    items, _ = media_request(req, MM)
    assert [i.uuid for i in items] == ["c78e1c105eaf0524" + "0" * 48, "ab112b8daa5dbb8c" + "0" * 48]
    assert routing_uuid("0123456789abcdef") == "0123456789abcdef" + "0" * 48
    grouped = with_media(
        ("video_url", VIDEO),
        ("image_url", PNG),
        mm_hashes_by_modality={"image": ["00000000000000ff"], "video": []},
    )
    items, _ = media_request(grouped, MM)
    assert [i.uuid for i in items] == [sha(VIDEO), routing_uuid("00000000000000ff")]


def test_one_modality_needs_no_messages_and_uuids_are_stable() -> None:
    req = with_media(("image_url", PNG), ("image_url", VIDEO), messages=False)
    first, _ = media_request(req, MM)
    again, _ = media_request(req, MM)
    assert summary(first) == [("image", "data_uri"), ("image", "url")] and first == again
    assert media_request(dynamo_request(), MM) == ([], None)
    assert media_request(dynamo_request(multi_modal_data={"image_url": []}), MM) == ([], None)


def test_data_uri_as_raw_bytes_for_an_engine_that_takes_only_bytes() -> None:
    raw_only = MultimodalCard(
        aggregate_modalities=["image"],
        prefill_decode_modalities=[],
        source_types=["raw_bytes"],
        supports_per_request_media_options=None,
        routing_image_token_id=None,
    )
    items, _ = media_request(with_media(("image_url", PNG)), raw_only)
    assert items[0].raw_bytes == b"\x89PNG fake" and items[0].mime_type == "image/png"
    assert items[0].uuid == sha(PNG)  # the same id whichever source is sent
    with pytest.raises(Rejection, match="image: only base64 data URIs"):
        media_request(with_media(("image_url", "data:image/png,rawtext")), raw_only)


def test_media_options_from_processor_kwargs() -> None:
    flat = with_media(("image_url", PNG), ("video_url", VIDEO))
    flat["mm_processor_kwargs"] = {"max_pixels": 1000}
    _, options = media_request(flat, MM)
    assert options is not None
    assert options.to_dict() == {"image": {"max_pixels": 1000}, "video": {"max_pixels": 1000}}
    keyed = with_media(("image_url", PNG))
    keyed["mm_processor_kwargs"] = {"image": {"min_pixels": 4}}
    assert media_request(keyed, MM)[1] == pb.Struct.from_dict({"image": {"min_pixels": 4}})


@pytest.mark.parametrize(
    ("request_", "code", "message"),
    [
        (
            dynamo_request(multi_modal_data={"image_url": [{"Decoded": {"shape": [2, 2, 3]}}]}),
            pb.ErrorCode.UNSUPPORTED_FEATURE,
            "image #1: the frontend sent it decoded",
        ),
        (
            dynamo_request(multi_modal_data={"vision_chunk": [{"Url": PNG}]}),
            pb.ErrorCode.UNSUPPORTED_FEATURE,
            "multi_modal_data.vision_chunk: not a modality",
        ),
        (
            dynamo_request(multi_modal_data={"audio_url": [{"Url": ""}]}),
            pb.ErrorCode.INVALID_ARGUMENT,
            "audio #1",
        ),
        (
            dynamo_request(multi_modal_data={"video_url": {"Url": VIDEO}}),
            pb.ErrorCode.INVALID_ARGUMENT,
            "list",
        ),
        (dynamo_request(multi_modal_data=["x"]), pb.ErrorCode.INVALID_ARGUMENT, "must be an object"),
        (
            dynamo_request(multi_modal_data={"image_url": [{"Url": PNG}] * (MAX_MEDIA_ITEMS + 1)}),
            pb.ErrorCode.INVALID_ARGUMENT,
            f"more than {MAX_MEDIA_ITEMS} media items",
        ),
        (
            with_media(("image_url", PNG), ("audio_url", AUDIO), messages=False),
            pb.ErrorCode.INVALID_ARGUMENT,
            "prompt order of the image, audio items cannot be recovered",
        ),
        (
            with_media(("image_url", PNG), mm_hashes=["c78e1c105eaf0524", "ab112b8daa5dbb8c"]),
            pb.ErrorCode.INVALID_ARGUMENT,
            "2 image routing hash(es) for 1 image item(s)",
        ),
        (
            with_media(("image_url", PNG), mm_hashes=["not-hex"]),
            pb.ErrorCode.INVALID_ARGUMENT,
            "16 hex digits",
        ),
    ],
)
def test_refused_never_dropped(request_: dict[str, Any], code: pb.ErrorCode, message: str) -> None:
    with pytest.raises(Rejection) as info:
        media_request(request_, MM)
    assert info.value.code == code and message in info.value.message


def admitted(request: dict[str, Any], **engine: Any) -> pb.GenerateRequest:
    card = mock_card(**engine)
    mapped = to_generate_request(request, card)
    return admit(mapped.request, mapped.metadata, card).request


def refusal(request: dict[str, Any], **engine: Any) -> str:
    with pytest.raises(Rejection) as info:
        admitted(request, **engine)
    assert info.value.code == pb.ErrorCode.UNSUPPORTED_FEATURE
    return info.value.message


def test_mapped_media_through_admission_per_flavour_card() -> None:
    image, video, audio = ("image_url", PNG), ("video_url", VIDEO), ("audio_url", AUDIO)
    ok = admitted(with_media(video, image, audio), flavor="trtllm")
    assert summary(ok.media) == [("video", "url"), ("image", "data_uri"), ("audio", "data_uri")]
    assert "video is not accepted on the aggregated path" in refusal(with_media(image, video), flavor="vllm")
    assert "audio is not accepted on the prefill/decode path" in refusal(
        with_media(audio), flavor="trtllm", role="prefill"
    )
    assert "does not accept media (image)" in refusal(with_media(image), flavor="vllm", text_only=True)
    opts = with_media(image)
    opts["mm_processor_kwargs"] = {"max_pixels": 1000}
    assert admitted(opts, flavor="vllm").media_options == pb.Struct.from_dict({"image": {"max_pixels": 1000}})
    assert "per-request media_options" in refusal(opts, flavor="sglang")
