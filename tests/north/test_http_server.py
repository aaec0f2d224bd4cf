"""The HTTP listener in process, on real loopback sockets: HTTP/1.1 only, one failing
connection or listener never ends the server, no redirect to a client's Host, bounded
handshakes / slow headers / header size / connections (in total and per peer, idle ones
making room), the Bearer scheme in any case (docs/SECURITY.md)."""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import h2.config
import h2.connection
import h2.events
import h11
import httpx
import hypercorn.trio.tcp_server
import pytest
import trio
import trustme
from trio_websocket import ConnectionRejected, open_websocket_url

from sidecar.core.metrics import HTTP_FAILURES, LIMIT_REFUSALS
from sidecar.north import wire
from sidecar.north._hypercorn_internals import Http11Only
from sidecar.north.auth import bearer_matches
from sidecar.north.http import NOT_THE_WEBSOCKET_PORT, build_app
from sidecar.north.http_server import HttpLimits, serve_http


class _Host:
    """The part of the core the HTTP app reads: always ready."""

    draining = False
    load = None

    def not_ready_reason(self) -> str | None:
        return None

    def current_card(self) -> Any:
        return {"card": True}


def failures(level: str) -> float:
    return HTTP_FAILURES.labels(level)._value.get()


@asynccontextmanager
async def listener(
    limits: HttpLimits | None = None, token: str | None = None, **tls: Any
) -> AsyncIterator[int]:
    app = build_app(_Host(), auth_token=token, open_probes=False)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(partial(serve_http, app, "127.0.0.1:0", limits=limits, **tls))
        yield port
        nursery.cancel_scope.cancel()


async def get(port: int, path: str = "/health", **kw: Any) -> httpx.Response:
    async with httpx.AsyncClient() as client:
        return await client.get(f"http://127.0.0.1:{port}{path}", timeout=5, **kw)


async def raw_exchange(port: int, data: bytes, *, wait: float = 5) -> bytes:
    """Send ``data`` on a fresh connection; everything the server sends until it closes (or ``wait``)."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    out = b""
    async with stream:
        await stream.send_all(data)
        with trio.move_on_after(wait):
            while chunk := await stream.receive_some(65536):
                out += chunk
    return out


async def lifespan(scope: Any, receive: Any, send: Any) -> bool:
    """Answer hypercorn's lifespan messages for a bare ASGI app; True when ``scope`` was lifespan."""
    if scope["type"] != "lifespan":
        return False
    while True:
        message = await receive()
        await send({"type": message["type"] + ".complete"})
        if message["type"] == "lifespan.shutdown":
            return True


async def closed_after(port: int, data: bytes, limit: float) -> float:
    """Seconds until the server closes a connection that sent ``data`` (fails past ``limit``)."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    start = trio.current_time()
    async with stream:
        await stream.send_all(data)
        with trio.fail_after(limit):
            while await stream.receive_some(65536):
                pass
    return trio.current_time() - start


async def test_http2_prior_knowledge_refused_upgrade_ignored_http11_served() -> None:
    """HTTP/2 is off on this port: the decision docs/SECURITY.md explains."""
    with trio.fail_after(20):
        async with listener() as port:
            # prior knowledge: the connection is closed, nothing is answered in HTTP/2
            conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
            conn.initiate_connection()
            conn.send_headers(
                1,
                [(":method", "GET"), (":path", "/health"), (":scheme", "http"), (":authority", "x")],
                end_stream=True,
            )
            reply = await raw_exchange(port, conn.data_to_send())
            events = (
                h2.connection.H2Connection(h2.config.H2Configuration(client_side=True)).receive_data(reply)
                if reply.startswith(b"\x00")
                else []
            )
            assert not any(isinstance(e, h2.events.ResponseReceived) for e in events)
            assert b"HTTP/1.1 200" not in reply
            # Upgrade: h2c is not acted on: a plain HTTP/1.1 answer, no 101
            reply = await raw_exchange(
                port,
                b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\n"
                b"Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAAP__\r\nConnection: close\r\n\r\n",
            )
            assert reply.startswith(b"HTTP/1.1 200"), reply[:80]
            assert b"101" not in reply.split(b"\r\n", 1)[0]
            # and HTTP/1.1 keeps working on the same listener
            assert (await get(port)).status_code == 200


async def test_tls_offers_http11_only_and_handshake_is_bounded(tmp_path: Path) -> None:
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    certfile, keyfile = tmp_path / "c.pem", tmp_path / "k.pem"
    cert.cert_chain_pems[0].write_to_path(str(certfile))
    cert.private_key_pem.write_to_path(str(keyfile))
    client_ctx = ssl.create_default_context()
    ca.configure_trust(client_ctx)
    client_ctx.set_alpn_protocols(["h2", "http/1.1"])
    limits = HttpLimits(handshake_timeout=0.5)
    with trio.fail_after(20):
        async with listener(limits, certfile=str(certfile), keyfile=str(keyfile)) as port:
            tcp = await trio.open_tcp_stream("127.0.0.1", port)
            tls = trio.SSLStream(tcp, client_ctx, server_hostname="127.0.0.1")
            async with tls:
                await tls.do_handshake()
                assert tls.selected_alpn_protocol() == "http/1.1"
            # a client that never starts its handshake is cut off after handshake_timeout
            assert await closed_after(port, b"", limit=5) < 3


async def test_failing_connection_is_closed_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """An exception in one connection's protocol code (e.g. hypercorn's HTTP/2 KeyError)
    closes that connection, is counted, and touches nothing else."""
    original = Http11Only._check_protocol

    async def boom(self: Any, event: Any) -> None:
        if event.target == b"/boom":
            raise KeyError(1)
        await original(self, event)

    monkeypatch.setattr(Http11Only, "_check_protocol", boom)
    conn0, listener0 = failures("connection"), failures("listener")
    with trio.fail_after(20):
        async with listener() as port:
            async with httpx.AsyncClient() as keep:  # a keep-alive connection opened before
                assert (await keep.get(f"http://127.0.0.1:{port}/health")).status_code == 200
                assert await raw_exchange(port, b"GET /boom HTTP/1.1\r\nHost: x\r\n\r\n") == b""
                assert (await keep.get(f"http://127.0.0.1:{port}/ready")).status_code == 200
            assert (await get(port)).status_code == 200
    assert failures("connection") == conn0 + 1
    assert failures("listener") == listener0


async def test_failed_listener_is_restarted_on_the_same_port(monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure outside any connection's protocol (it propagates out of hypercorn's worker)
    restarts the listener; the bound socket is kept, so later clients are served."""
    original = hypercorn.trio.tcp_server.TCPServer.run
    crashes = [1]

    async def run(self: Any) -> None:
        if crashes:
            crashes.pop()
            raise RuntimeError("injected listener failure")
        await original(self)

    monkeypatch.setattr(hypercorn.trio.tcp_server.TCPServer, "run", run)
    before = failures("listener")
    with trio.fail_after(20):
        async with listener(HttpLimits(restart_delay=0.05)) as port:
            with pytest.raises(httpx.TransportError):
                await get(port)
            assert (await get(port)).status_code == 200
    assert failures("listener") == before + 1


async def test_no_redirect_to_a_client_supplied_host() -> None:
    with trio.fail_after(20):
        async with listener() as port:
            for path in ("/metrics/", "/health/", "/v1/worker/"):
                r = await get(port, path, headers={"host": "evil.example"})
                assert r.status_code == 404, path
                assert "location" not in r.headers
            assert (await get(port, "/metrics")).status_code == 200


def test_bearer_scheme_is_case_insensitive_token_is_not() -> None:
    for header in ("Bearer tok", "bearer tok", "BEARER tok", "  Bearer   tok ", b"bEaReR tok"):
        assert bearer_matches(header, "tok"), header
    for header in (None, "", "tok", "Bearer", "Bearer TOK", "Bearer tokx", "Basic tok", "Bearertok"):
        assert not bearer_matches(header, "tok"), header


async def test_bearer_in_any_case_on_http() -> None:
    with trio.fail_after(20):
        async with listener(token="s3cret") as port:
            assert (await get(port, "/metrics")).status_code == 401
            for scheme in ("Bearer", "bearer", "BEARER"):
                r = await get(port, "/metrics", headers={"authorization": f"{scheme} s3cret"})
                assert r.status_code == 200, scheme
            r = await get(port, "/metrics", headers={"authorization": "bearer S3CRET"})
            assert r.status_code == 401


async def test_slow_headers_idle_and_oversized_headers_are_cut_off() -> None:
    limits = HttpLimits(idle_timeout=0.5, max_header_bytes=4096)
    with trio.fail_after(30):
        async with listener(limits) as port:
            lasted: list[float] = []

            async def slowloris() -> None:
                stream = await trio.open_tcp_stream("127.0.0.1", port)
                start = trio.current_time()
                async with stream:
                    await stream.send_all(b"GET /health HTTP/1.1\r\nHost: x\r\n")
                    try:
                        for _ in range(50):  # one header line every 0.1 s: never complete
                            await stream.send_all(b"X-Slow: 1\r\n")
                            with trio.move_on_after(0.1):
                                if not await stream.receive_some(1024):
                                    break
                    except trio.BrokenResourceError:
                        pass
                lasted.append(trio.current_time() - start)

            async with trio.open_nursery() as nursery:
                for _ in range(20):
                    nursery.start_soon(slowloris)
                # meanwhile a normal client is served at once
                start = trio.current_time()
                assert (await get(port)).status_code == 200
                assert trio.current_time() - start < 1
            assert len(lasted) == 20 and max(lasted) < 3, lasted
            assert await closed_after(port, b"", limit=3) < 3  # idle: same bound
            pad = b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"X-Pad: a\r\n" * 500
            assert (await raw_exchange(port, pad + b"\r\n")).startswith(b"HTTP/1.1 431")  # in one read
            stream = await trio.open_tcp_stream("127.0.0.1", port)  # or trickled past the bound
            async with stream:
                reply = b""
                await stream.send_all(b"GET /health HTTP/1.1\r\nHost: x\r\n")
                with trio.move_on_after(5):
                    for _ in range(100):
                        await stream.send_all(b"X-Pad: " + b"a" * 100 + b"\r\n")
                        with trio.move_on_after(0.01):
                            reply += await stream.receive_some(65536)
                        if reply:
                            break
                assert reply.startswith(b"HTTP/1.1 431"), reply[:60]


def refusals(limit: str) -> float:
    return float(LIMIT_REFUSALS.labels(limit)._value.get())


async def still_open(stream: trio.SocketStream) -> bool:
    """Whether the server has not closed ``stream`` (it never sent anything on it)."""
    with trio.move_on_after(0.05):
        try:
            return bool(await stream.receive_some(1))
        except trio.BrokenResourceError:
            return False
    return True


async def idle_connections(port: int, count: int, source: str) -> list[trio.SocketStream]:
    return [await trio.open_tcp_stream("127.0.0.1", port, local_address=source) for _ in range(count)]


async def test_idle_floods_make_room_for_a_probe_in_total_and_per_peer() -> None:
    """Over ``max_connections_per_peer`` the peer's oldest idle connection is closed for the
    new one; over ``max_connections`` the oldest idle of any peer. A probe from the flooding
    address itself, or from another, is served at once; the flood never holds more than the
    limits."""
    limits = HttpLimits(max_connections=8, max_connections_per_peer=4)
    per_peer, total = refusals("http_connections_per_peer"), refusals("http_connections")
    with trio.fail_after(30):
        async with listener(limits) as port:
            flood = await idle_connections(port, 40, "127.0.0.1")
            start = trio.current_time()
            assert (await get(port, "/health")).status_code == 200  # from the flooding address
            assert trio.current_time() - start < 1
            held = [s for s in flood if await still_open(s)]
            assert held == flood[-3:]  # 4 allowed: the probe took the oldest's place
            assert refusals("http_connections_per_peer") - per_peer == 40 - 4 + 1
            others = [await idle_connections(port, 4, f"127.0.0.{i}") for i in (2, 3)]
            assert [await still_open(s) for s in flood[-3:]] == [False, False, False]
            assert sum([await still_open(s) for group in others for s in group]) == 8
            assert refusals("http_connections") - total == 3  # 11 idle by then; 8 allowed
            async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(local_address="127.0.0.4")) as c:
                assert (await c.get(f"http://127.0.0.1:{port}/health", timeout=2)).status_code == 200
            for s in flood + [s for group in others for s in group]:
                await s.aclose()


async def test_a_new_connection_is_refused_when_none_is_idle() -> None:
    """Connections with a request in progress are never closed to make room: the new one is
    answered 503 (``Retry-After``) at once and not counted; the busy ones are answered."""
    release = trio.Event()

    async def slow_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    limits = HttpLimits(max_connections=2, max_connections_per_peer=2)
    before = refusals("http_connections")
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(partial(serve_http, slow_app, "127.0.0.1:0", limits=limits))
            busy = await idle_connections(port, 2, "127.0.0.2")
            for s in busy:
                await s.send_all(b"GET /x HTTP/1.1\r\nHost: x\r\n\r\n")
            refused = await raw_exchange(port, b"GET /x HTTP/1.1\r\nHost: x\r\n\r\n")
            assert refused.startswith(b"HTTP/1.1 503") and b"Retry-After: 1" in refused
            assert b"http_connections" in refused
            assert refusals("http_connections") - before == 1
            release.set()
            for s in busy:
                assert (await s.receive_some(1024)).startswith(b"HTTP/1.1 200")
                await s.aclose()
            nursery.cancel_scope.cancel()


async def test_tls_connections_count_from_the_accept(tmp_path: Path) -> None:
    """Half-open TLS handshakes hold connections too: they are counted (and make room) from
    the TCP accept, before hypercorn's handshake."""
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    certfile, keyfile = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.private_key_and_cert_chain_pem.write_to_path(str(certfile))
    cert.private_key_pem.write_to_path(str(keyfile))
    limits = HttpLimits(max_connections=8, max_connections_per_peer=4)
    before = refusals("http_connections_per_peer")
    with trio.fail_after(30):
        async with listener(limits, certfile=str(certfile), keyfile=str(keyfile)) as port:
            silent = await idle_connections(port, 10, "127.0.0.1")  # never start the handshake
            assert [await still_open(s) for s in silent] == [False] * 6 + [True] * 4
            ctx = ssl.create_default_context()
            ca.configure_trust(ctx)
            async with httpx.AsyncClient(verify=ctx) as client:
                assert (await client.get(f"https://127.0.0.1:{port}/health", timeout=5)).status_code == 200
            assert refusals("http_connections_per_peer") - before == 6 + 1
            for s in silent:
                await s.aclose()


@pytest.mark.parametrize("token", [None, "s3cret"])
async def test_a_websocket_handshake_is_told_which_port_serves_websockets(token: str | None) -> None:
    """A client pointed at this port instead of --listen got Starlette's 403, which read like an
    authorization failure: 400, a body naming the right port, and the header the client reads
    (the same with a token: the answer says nothing about authorization)."""
    with trio.fail_after(20):
        async with listener(token=token) as port:
            for path in ("/v1/ws", "/", "/metrics"):
                with pytest.raises(ConnectionRejected) as caught:
                    async with open_websocket_url(f"ws://127.0.0.1:{port}{path}"):
                        pass
                rejected = caught.value
                assert rejected.status_code == 400, path
                assert (wire.LISTENER_HEADER.encode(), b"http") in rejected.headers
                assert rejected.body == NOT_THE_WEBSOCKET_PORT.encode()
            assert (await get(port, headers={"authorization": f"Bearer {token}"})).status_code == 200


async def test_a_streamed_body_larger_than_the_socket_buffers_arrives_whole() -> None:
    """Writes the kernel takes only in part (a client reading slower than the app writes) go on
    through the stream, in order: 4,096 numbered chunks of 4 KiB (16 MiB) arrive byte for byte
    on a listener with a write timeout (the OpenAI listener's write path), then a second request
    on the same connection is answered."""
    chunks = [f"{i:08d}".encode() * 512 for i in range(4096)]

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if await lifespan(scope, receive, send):
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for chunk in chunks if scope["path"] == "/big" else [b"small"]:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    limits = HttpLimits(write_timeout=10.0)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(partial(serve_http, app, "127.0.0.1:0", limits=limits))
        with trio.fail_after(60):
            async with httpx.AsyncClient() as client:
                body = bytearray()
                async with client.stream("GET", f"http://127.0.0.1:{port}/big", timeout=30) as r:
                    async for part in r.aiter_raw(1024):  # small reads: the server's writes block
                        body += part
                assert bytes(body) == b"".join(chunks)
                assert (await client.get(f"http://127.0.0.1:{port}/small", timeout=5)).content == b"small"
        nursery.cancel_scope.cancel()


async def test_chunked_body_framed_byte_for_byte_length_bodies_left_to_h11(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A chunked body's chunks are framed by the listener itself (h11 sees none of them), byte
    for byte as RFC 9112 §7.1 and h11 frame them; a body of a declared length still goes through
    h11, which checks it; the connection serves the next request after both."""
    through_h11: list[str] = []
    original = h11.Connection.send

    def counting(self: h11.Connection, event: Any) -> bytes | None:
        through_h11.append(type(event).__name__)
        return original(self, event)

    monkeypatch.setattr(h11.Connection, "send", counting)
    parts = [b"a", b"bb" * 100, b"\r\n0\r\n"]

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if await lifespan(scope, receive, send):
            return
        if scope["path"] == "/length":
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"5")]})
            await send({"type": "http.response.body", "body": b"hello"})
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for part in parts:
            await send({"type": "http.response.body", "body": part, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    limits = HttpLimits(write_timeout=10.0)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(partial(serve_http, app, "127.0.0.1:0", limits=limits))
        requests = b"GET /chunked HTTP/1.1\r\nhost: x\r\n\r\nGET /length HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
        with trio.fail_after(10):
            raw = await raw_exchange(port, requests)
        nursery.cancel_scope.cancel()
    first, second = raw.split(b"HTTP/1.1 200 ", 2)[1:]
    assert b"transfer-encoding: chunked\r\n" in first.lower()
    body = first.split(b"\r\n\r\n", 1)[1]
    assert body == b"1\r\na\r\nc8\r\n" + b"bb" * 100 + b"\r\n5\r\n\r\n0\r\n\r\n0\r\n\r\n"
    assert b"content-length: 5\r\n" in second.lower() and second.endswith(b"\r\n\r\nhello")
    assert through_h11.count("Data") == 1  # the declared-length body only
    assert through_h11.count("Response") == 2 and through_h11.count("EndOfMessage") == 2
