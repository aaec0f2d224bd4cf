"""Dynamo's ``multi_modal_data`` → OpenEngine ``GenerateRequest.media`` (pure, no Dynamo import).

What Dynamo 1.6.1's frontend sends a worker registered without a media decoder (URL
pass-through, the registration this sidecar makes: OpenEngine engines fetch and decode
media themselves, and a frontend-decoded item is a pixel tensor behind an RDMA descriptor
that no ``MediaItem`` source can carry):

- ``multi_modal_data``: ``{"image_url": [{"Url": U}, …], "video_url": […], "audio_url": […]}``,
  one list per modality, each in prompt order. ``U`` is the client's URL or data URI.
- ``extra_args.messages``: the request's messages (inline data URIs blanked). The frontend
  built the lists by walking the content parts of the user and tool messages in order; the
  map itself loses the order *across* modalities, so it is recovered from these parts.
- ``extra_args.mm_hashes``: one 16-hex-digit routing hash per image (XXH3-64 of its URL),
  present only when the frontend built media-aware routing info for the request;
  ``extra_args.mm_hashes_by_modality`` the same per modality.
- ``mm_processor_kwargs``: per-request media processor options.

Mapping, item by item in prompt order:

- ``modality``: ``image_url`` / ``video_url`` / ``audio_url`` → IMAGE / VIDEO / AUDIO.
- source: a ``data:`` URI → ``data_uri`` when the engine advertises it, else ``raw_bytes``
  (base64-decoded, ``mime_type`` from the URI) when it advertises that; anything else →
  ``url``. The sidecar never fetches a URL. A source the engine does not advertise is left
  for admission to refuse (UNSUPPORTED_FEATURE naming the modality).
- ``uuid``: the frontend's routing hash in Dynamo's canonical KV-event form — the 16 hex
  digits then 48 zeros, the form Dynamo's KV router recognises in an engine's
  ``BlockStored.extra_keys`` and turns into ``pad_value(mm_hash)`` — so the engine's KV
  events for the item key the blocks the way the frontend's routing tokens do. Without a
  routing hash: ``sha256:`` + the SHA-256 of the source string, stable across repeats and
  across the prefill and decode requests of one pair.
- ``mm_processor_kwargs`` → ``media_options``: used as is when keyed by modality
  (``{"image": {…}}``), else applied to every modality the request carries. Admission
  refuses them for an engine without per-request media options.

Refused with a :class:`~sidecar.core.errors.Rejection` naming the modality: an unknown
``multi_modal_data`` key, a frontend-decoded or uuid-only item, a malformed item or hash
list, more than :data:`MAX_MEDIA_ITEMS` items, and several modalities whose prompt order
cannot be recovered. Nothing is ever dropped.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from sidecar.core.card import MultimodalCard
from sidecar.core.errors import invalid_argument, unsupported
from sidecar.core.request_options import media_item, source_uuid
from sidecar.openengine import pb

__all__ = ["MAX_MEDIA_ITEMS", "MODALITY_KEYS", "media_request", "routing_uuid"]

#: Most media items one Dynamo request may carry (checked before any item is mapped).
MAX_MEDIA_ITEMS = 128
#: ``multi_modal_data`` keys → modality (and its name in messages and ``media_options``).
MODALITY_KEYS = {
    "image_url": (pb.Modality.IMAGE, "image"),
    "video_url": (pb.Modality.VIDEO, "video"),
    "audio_url": (pb.Modality.AUDIO, "audio"),
}
_BY_NAME = {name: key for key, (_, name) in MODALITY_KEYS.items()}
_HASH = re.compile(r"[0-9a-fA-F]{16}")
#: Roles whose content parts Dynamo's frontend collects media from.
_MEDIA_ROLES = ("user", "tool")


def routing_uuid(mm_hash: str) -> str:
    """Dynamo's canonical KV-event form of a frontend routing hash (16 hex digits + 48 zeros)."""
    return mm_hash.lower() + "0" * 48


def _urls(key: str, items: Any) -> list[str]:
    name = MODALITY_KEYS[key][1]
    if not isinstance(items, list):
        invalid_argument(f"multi_modal_data.{key} must be a list")
    urls = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            url = item
        elif isinstance(item, Mapping) and set(item) == {"Url"} and isinstance(item["Url"], str):
            url = item["Url"]
        elif isinstance(item, Mapping) and ("Decoded" in item or "UuidOnly" in item):
            unsupported(
                f"{name} #{i + 1}: the frontend sent it decoded ({next(iter(item))}); an OpenEngine "
                "engine fetches and decodes media itself: serve this model without frontend decoding"
            )
        else:
            invalid_argument(f"{name} #{i + 1}: expected {{'Url': URL}} in multi_modal_data.{key}")
        if not url:
            invalid_argument(f"{name} #{i + 1}: empty URL")
        urls.append(url)
    return urls


def _prompt_order(extra: Mapping[str, Any], counts: Counter[str]) -> list[str] | None:
    """The modality keys of the request's media in prompt order, from ``extra_args.messages``."""
    messages = extra.get("messages")
    if not isinstance(messages, list):
        return None
    order: list[str] = []
    for message in messages:
        if not isinstance(message, Mapping) or message.get("role") not in _MEDIA_ROLES:
            continue
        content = message.get("content")
        if isinstance(content, list):
            order.extend(
                p["type"] for p in content if isinstance(p, Mapping) and p.get("type") in MODALITY_KEYS
            )
    return order if Counter(order) == counts else None


def _hashes(extra: Mapping[str, Any], counts: Counter[str]) -> dict[str, list[str]]:
    """Routing hashes per modality key (validated: one 16-hex string per item)."""
    out: dict[str, list[str]] = {}
    grouped = extra.get("mm_hashes_by_modality")
    if grouped is not None:
        if not isinstance(grouped, Mapping):
            invalid_argument("extra_args.mm_hashes_by_modality must be an object")
        for modality, hashes in grouped.items():
            key = modality if modality in MODALITY_KEYS else _BY_NAME.get(modality)
            if key is None:
                invalid_argument(f"extra_args.mm_hashes_by_modality: unknown modality {modality!r}")
            if hashes:
                out[key] = hashes
    elif extra.get("mm_hashes"):
        out["image_url"] = extra["mm_hashes"]
    for key, hashes in out.items():
        name = MODALITY_KEYS[key][1]
        if not isinstance(hashes, list) or not all(isinstance(h, str) and _HASH.fullmatch(h) for h in hashes):
            invalid_argument(f"extra_args: the {name} routing hashes must be 16 hex digits each")
        if len(hashes) != counts[key]:
            invalid_argument(
                f"extra_args: {len(hashes)} {name} routing hash(es) for {counts[key]} {name} item(s)"
            )
    return out


def _media_options(kwargs: Any, keys: Sequence[str]) -> pb.Struct | None:
    if not kwargs:
        return None
    if not isinstance(kwargs, Mapping):
        invalid_argument("mm_processor_kwargs must be an object")
    if all(k in _BY_NAME for k in kwargs):
        options = dict(kwargs)  # already keyed by modality (admission checks each value)
    else:
        options = {MODALITY_KEYS[k][1]: dict(kwargs) for k in dict.fromkeys(keys)}
    return pb.Struct.from_dict(options)


def media_request(
    request: Mapping[str, Any], mm: MultimodalCard | None
) -> tuple[list[pb.MediaItem], pb.Struct | None]:
    """The ``media`` and ``media_options`` of one Dynamo request (see the module doc).

    ``mm``: the served model's multimodal capabilities (``None``: unknown or text-only; the
    items are mapped as they came and admission decides).
    """
    data = request.get("multi_modal_data")
    if not data:
        return [], None
    if not isinstance(data, Mapping):
        invalid_argument("multi_modal_data must be an object")
    lists: dict[str, list[str]] = {}
    total = 0
    for key, items in data.items():
        if key not in MODALITY_KEYS:
            unsupported(
                f"multi_modal_data.{key}: not a modality this worker forwards (image_url, video_url, audio_url)"
            )
        total += len(items) if isinstance(items, list) else 0
        if total > MAX_MEDIA_ITEMS:
            invalid_argument(f"more than {MAX_MEDIA_ITEMS} media items in one request")
        lists[key] = _urls(key, items)
    counts = Counter({key: len(urls) for key, urls in lists.items() if urls})
    if not counts:
        return [], None
    extra = request.get("extra_args")
    extra = extra if isinstance(extra, Mapping) else {}
    order = _prompt_order(extra, counts)
    if order is None:
        if len(counts) > 1:
            invalid_argument(
                f"the prompt order of the {', '.join(MODALITY_KEYS[k][1] for k in counts)} items cannot be "
                "recovered (extra_args.messages is missing or does not match multi_modal_data)"
            )
        order = list(counts.elements())
    hashes = _hashes(extra, counts)
    taken: Counter[str] = Counter()
    items = []
    for key in order:
        i = taken[key]
        taken[key] += 1
        url = lists[key][i]
        routed = hashes.get(key)
        uuid = routing_uuid(routed[i]) if routed else source_uuid(url)
        modality, name = MODALITY_KEYS[key]
        items.append(media_item(modality, name, url, uuid, mm))
    return items, _media_options(request.get("mm_processor_kwargs"), order)
