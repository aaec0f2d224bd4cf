"""Tools of the reliability tests: process memory, Prometheus scrapes, engine progress, raw
WebSocket clients whose socket buffers the test controls.

Everything here talks to real processes started with ``tests.e2e.harness`` (a simulated
engine and ``openengine-sidecar run``); nothing is mocked inside the sidecar.
"""

from __future__ import annotations

import json
import socket
import ssl
import urllib.parse
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import trio
from prometheus_client.parser import text_string_to_metric_families
from trio_websocket import WebSocketConnection, wrap_client_stream

from sidecar.openengine import pb
from sidecar.openengine.client import open_engine_client


def rss_kib(pid: int) -> int:
    """Resident set size of ``pid`` in KiB (``VmRSS`` of /proc/PID/status)."""
    with open(f"/proc/{pid}/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError(f"no VmRSS for pid {pid}")


@dataclass
class Metrics:
    """One scrape of ``/metrics``: ``value(name, **labels)`` sums the matching samples."""

    samples: list[tuple[str, dict[str, str], float]] = field(default_factory=list)

    def value(self, name: str, **labels: str) -> float:
        return sum(
            v
            for n, lab, v in self.samples
            if n == name and all(lab.get(k) == want for k, want in labels.items())
        )


async def scrape(http: str, *, token: str | None = None, verify: Any = True) -> Metrics:
    """GET ``/metrics`` of a sidecar and parse it."""
    headers = {"authorization": f"Bearer {token}"} if token else {}
    async with httpx.AsyncClient(verify=verify) as client:
        r = await client.get(http + "/metrics", headers=headers, timeout=5)
    r.raise_for_status()
    out = Metrics()
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            out.samples.append((s.name, dict(s.labels), s.value))
    return out


async def engine_load(address: str) -> pb.LoadInfo:
    """The simulated engine's ``GetLoad`` (``running_tokens`` is its generation progress:
    prompt + completion tokens of its running requests). Needs ``aio_loop``."""
    async with open_engine_client(address) as client:
        with trio.fail_after(5):
            return await client.get_load()


# --- raw WebSocket clients ---------------------------------------------------------------------


@asynccontextmanager
async def raw_ws(
    url: str,
    *,
    rcvbuf: int | None = None,
    headers: list[tuple[bytes, bytes]] | None = None,
    ssl_context: ssl.SSLContext | None = None,
    message_queue_size: int = 1,
) -> AsyncIterator[tuple[WebSocketConnection, trio.SocketStream]]:
    """A trio-websocket client on a socket we own: ``rcvbuf`` shrinks its kernel receive
    buffer (set before connecting, so the TCP window stays small), and the yielded
    ``SocketStream`` can be closed abruptly to simulate a client that vanishes.

    A client that stops calling ``get_message`` stops reading the socket once
    ``message_queue_size`` messages are queued (trio-websocket's reader pauses).
    """
    parts = urllib.parse.urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    sock = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_STREAM)
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    await sock.connect((host, port))
    stream: Any = trio.SocketStream(sock)
    if ssl_context is not None:
        stream = trio.SSLStream(stream, ssl_context, server_hostname=host)
    async with trio.open_nursery() as nursery:
        ws = await wrap_client_stream(
            nursery,
            stream,
            host,
            parts.path or "/v1/ws",
            extra_headers=headers,
            message_queue_size=message_queue_size,
            max_message_size=16 * 2**20,
        )
        try:
            yield ws, stream
        finally:
            with trio.move_on_after(1) as scope:  # a peer stuck writing to us cannot answer
                scope.shield = True
                await ws.aclose()
            nursery.cancel_scope.cancel()


def abort_socket(stream: trio.SocketStream) -> None:
    """Make the next close of ``stream`` send a TCP RST (SO_LINGER 0): a client that vanishes."""
    stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")


def generate(stream: int | str, request: dict[str, Any], **fields: Any) -> str:
    """A JSON ``generate`` frame."""
    return json.dumps({"type": "generate", "stream": stream, "request": request, **fields})


def stall_request(max_tokens: int = 50, stall_after: int = 1, **extra: Any) -> dict[str, Any]:
    """A request the mock engine stops answering after ``stall_after`` token events."""
    from tests.e2e.harness import generate_request

    return generate_request(
        max_tokens=max_tokens, extra={"mock": {"faults": [f"stall={stall_after}"]}}, **extra
    )
