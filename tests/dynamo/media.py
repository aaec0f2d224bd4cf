"""Media for the Dynamo end-to-end tests: images made here, chat bodies, the engine's own record.

Images are real PNG files built in memory (no imaging library), sent as data URIs so the
frontend never fetches anything. The simulated engine records every accepted request's
media in ``GetLoad.attributes.recent_requests[request_id].media`` (modality, source kind,
uuid, in the order received); a Dynamo request's id is the chat completion's id without
its ``chatcmpl-`` prefix.
"""

from __future__ import annotations

import base64
import struct
import zlib
from typing import Any

import httpx

from tests.dynamo.e2e import MODEL, Frontend
from tests.e2e.harness import engine_counters

#: A URL source no test request ever makes anyone fetch (the frontend passes URLs through).
VIDEO_URL = "http://127.0.0.1:9/clip.mp4"
AUDIO_DATA_URI = "data:audio/wav;base64,UklGRiQAAABXQVZFZm10IBAAAAABAAEAQB8AAIA+AAACABAAZGF0YQAAAAA="


def png_data_uri(width: int, height: int, rgb: tuple[int, int, int] = (200, 40, 40)) -> str:
    """A ``width`` x ``height`` PNG of one colour, as a base64 data URI."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    rows = b"".join(b"\x00" + bytes(rgb) * width for _ in range(height))
    png = (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
        + chunk(b"IDAT", zlib.compress(rows))
        + chunk(b"IEND", b"")
    )
    return "data:image/png;base64," + base64.b64encode(png).decode()


def text(value: str) -> dict[str, Any]:
    return {"type": "text", "text": value}


def image(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def video(url: str = VIDEO_URL) -> dict[str, Any]:
    return {"type": "video_url", "video_url": {"url": url}}


def audio(url: str = AUDIO_DATA_URI) -> dict[str, Any]:
    return {"type": "audio_url", "audio_url": {"url": url}}


async def chat(
    fe: Frontend, content: list[dict[str, Any]], *, model: str = MODEL, **body: Any
) -> httpx.Response:
    """One non-streaming chat completion whose user message is ``content``."""
    payload = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 2, **body}
    return await fe.http.post("/v1/chat/completions", json=payload)


def request_id(resp: httpx.Response) -> str:
    """The Dynamo request id of a chat completion (what the engine records it under)."""
    rid: str = resp.json()["id"]
    return rid.removeprefix("chatcmpl-")


async def received(address: str, rid: str) -> dict[str, Any]:
    """The engine's record of request ``rid`` (``recent_requests`` entry)."""
    recent: dict[str, Any] = (await engine_counters(address))["recent_requests"]
    assert rid in recent, f"the engine has no record of {rid}: {sorted(recent)}"
    entry: dict[str, Any] = recent[rid]
    return entry


def media_of(entry: dict[str, Any]) -> list[tuple[str, str]]:
    """(modality, source kind) of each media item the engine received, in order."""
    return [(m["modality"].removeprefix("MODALITY_").lower(), m["source"]) for m in entry["media"]]
