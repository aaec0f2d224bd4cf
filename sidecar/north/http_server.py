"""The HTTP listener (probes, metrics, worker card): hypercorn's trio worker, hardened.

What this adds to a plain ``hypercorn.trio.serve`` (docs/SECURITY.md "HTTP listener"):

- **HTTP/1.1 only.** HTTP/2 is off: no ``h2`` in TLS ALPN, an ``Upgrade: h2c`` header is
  ignored (the request is answered in HTTP/1.1, as RFC 9110 §7.8 allows), and a connection
  opening with the HTTP/2 prior-knowledge preface is closed. Hypercorn's HTTP/2 code raised
  ``KeyError`` when a request body arrived after its response (upstream bug, open), which
  ended the whole process; probes and scrapers speak HTTP/1.1 anyway.
- **A failing connection never takes the listener down**: an exception from the protocol
  code of one connection is logged, counted (``openengine_sidecar_http_failures_total
  {level="connection"}``) and that connection closed. Should the listener itself fail, it is
  logged, counted (``level="listener"``) and restarted on the same, still-bound socket
  (connections wait in the backlog meanwhile); nothing propagates to the sidecar's nursery.
- Limits: TLS handshake timeout (equal to the WebSocket listener's), idle/slow-header
  timeout, request line + header bytes, open connections in total and per peer address
  (:mod:`sidecar.north.http_connections`: counted from the accept; over a limit the oldest
  idle connection makes room, so idle floods cannot keep a probe out).

Hypercorn offers no switch for HTTP/2 cleartext, no per-connection error boundary and no
connection limit, so its trio worker is given our per-connection server and protocol wrapper:
everything that relies on hypercorn beyond its documented ``serve`` is in
``sidecar.north._hypercorn_internals`` (one module, guarded by a test).
``tests/north/test_http_server.py`` pins the behaviour against the locked hypercorn version.
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass
from functools import partial

import trio
from starlette.types import ASGIApp, Receive, Scope, Send

from sidecar.core.metrics import HTTP_FAILURES
from sidecar.north._hypercorn_internals import (
    HypercornConfig,
    asgi_app,
    describe_failure,
    duplicate_sockets,
    install,
    listening_sockets,
    run_worker,
)
from sidecar.north.http_connections import HttpConnections

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HttpLimits:
    """Limits of the HTTP listener (CLI: ``--http-idle-timeout``, ``--http-max-header-bytes``,
    ``--http-max-connections``, ``--http-max-connections-per-peer``; the TLS handshake timeout
    is the WebSocket listener's)."""

    #: A TLS client that has not finished its handshake by then is disconnected.
    handshake_timeout: float = 10.0
    #: A connection with no complete request for this long is closed (idle keep-alive
    #: connections, and slowloris clients trickling a request line or headers).
    idle_timeout: float = 5.0
    #: Requests whose headers are larger than this are refused (431) and the connection closed.
    max_header_bytes: int = 16 * 1024
    #: Pause before a failed listener is started again.
    restart_delay: float = 0.5
    #: Open connections in total and per peer address (0: no limit; see http_connections).
    max_connections: int = 128
    max_connections_per_peer: int = 16
    #: Before the connection limits' names (``limit`` label of the refusals): ``http_``, ``openai_``.
    prefix: str = "http_"
    #: A response write the client takes nothing of for this long closes the connection
    #: (None: never; the OpenAI listener's is ``--stall-timeout``).
    write_timeout: float | None = None


def _limit_headers(app: ASGIApp, max_bytes: int) -> ASGIApp:
    """ASGI middleware: 431 for a request whose headers (as sent: ``name: value\\r\\n``) exceed ``max_bytes``.

    (h11's own bound only applies to a request still incomplete after one socket read.)
    """

    async def limited(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and sum(len(k) + len(v) + 4 for k, v in scope["headers"]) > max_bytes:
            await send({"type": "http.response.start", "status": 431, "headers": [(b"connection", b"close")]})
            await send({"type": "http.response.body", "body": b""})
            return
        await app(scope, receive, send)

    return limited


def _config(bind: str, certfile: str | None, keyfile: str | None, limits: HttpLimits) -> HypercornConfig:
    config = HypercornConfig()
    config.connections = HttpConnections(
        limits.max_connections, limits.max_connections_per_peer, prefix=limits.prefix
    )
    config.bind = [bind]
    config.accesslog = None
    config.errorlog = None
    config.graceful_timeout = 1.0
    config.alpn_protocols = ["http/1.1"]
    config.ssl_handshake_timeout = limits.handshake_timeout
    config.keep_alive_timeout = limits.idle_timeout
    config.h11_max_incomplete_size = limits.max_header_bytes
    config.write_timeout = limits.write_timeout
    if certfile:
        config.certfile, config.keyfile = certfile, keyfile
    return config


async def serve_http(
    app: ASGIApp,
    bind: str,
    *,
    certfile: str | None = None,
    keyfile: str | None = None,
    limits: HttpLimits | None = None,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the ASGI ``app`` on ``bind`` (``host:port``) until cancelled; ``task_status.started(port)``.

    The socket is bound once (an ``OSError`` if it cannot be, before reporting) and kept
    across listener restarts (each run of hypercorn gets a duplicate of it). Never raises after reporting, except ``Cancelled``.
    """
    install()
    limits = limits or HttpLimits()
    config = _config(bind, certfile, keyfile, limits)
    sockets = config.create_sockets()
    listening: list[socket.socket] = listening_sockets(sockets)
    try:
        for sock in listening:
            sock.listen(config.backlog)
        port = int(listening[0].getsockname()[1])
        asgi = asgi_app(_limit_headers(app, limits.max_header_bytes), config)
        started = False
        while True:
            try:
                # hypercorn closes the sockets it served on: give it duplicates, keep the originals
                run = duplicate_sockets(sockets)
                async with trio.open_nursery() as nursery:
                    await nursery.start(partial(run_worker, asgi, config, run))
                    if not started:
                        task_status.started(port)
                        started = True
                return  # hypercorn only returns once shut down
            except Exception as exc:
                if not started:
                    raise
                HTTP_FAILURES.labels("listener").inc()
                log.error(
                    "HTTP listener on port %d failed (%s); restarting",
                    port,
                    describe_failure(exc),
                    exc_info=log.isEnabledFor(logging.DEBUG),
                )
            await trio.sleep(limits.restart_delay)
    finally:
        for sock in listening:
            sock.close()
