"""HTTP endpoints: ``/health``, ``/ready``, ``/metrics``, ``/v1/worker``, ``/v1/load``, ``/v1/schema``.

A Starlette app, served by :func:`sidecar.north.http_server.serve_http` (hypercorn's trio
worker inside the sidecar's nursery; no hand-written HTTP). ``/health`` is liveness (the
process and its event loop answer); ``/ready`` is 200 only when negotiated, discovered,
engine healthy and not draining; ``/v1/schema`` is the north protocol's JSON Schema
(``sidecar.north.schema``, as docs/protocol.schema.json). Paths are exact: ``/metrics/`` is 404, never a redirect
(Starlette's would point at whatever ``Host`` the client sent).

A WebSocket handshake (a client pointed at this port instead of ``--listen``) is answered 400
with a body saying which port serves the stream protocol, and the header
:data:`sidecar.north.wire.LISTENER_HEADER` ``: http`` by which ``sidecar.client`` recognises it (Starlette's own
answer, 403, read like an authorization failure).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

import trio
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket

from sidecar.core import int64
from sidecar.core.card import WorkerCard
from sidecar.core.load import LoadTracker
from sidecar.metrics_registry import REGISTRY
from sidecar.north.auth import bearer_matches
from sidecar.north.schema import schema_json
from sidecar.north.wire import LISTENER_HEADER

_json = int64.json_encoder  # 64-bit integers as decimal strings (docs/PROTOCOL.md)

#: The body of that answer on the HTTP port.
NOT_THE_WEBSOCKET_PORT = (
    "this is the sidecar's HTTP port (probes, metrics, worker card); the WebSocket stream protocol "
    "is served on its --listen address (default port 8600)\n"
)


class HttpHost(Protocol):
    """What the HTTP plane reads from the core (``sidecar.core.sidecar.Sidecar``)."""

    def not_ready_reason(self) -> str | None: ...

    def current_card(self) -> WorkerCard | None: ...

    @property
    def draining(self) -> bool: ...

    load: LoadTracker


#: A route's handler.
Endpoint = Callable[[Request], Awaitable[Response]]


def _json_response(body: object, status: int = 200) -> Response:
    return Response(_json.encode(body), status_code=status, media_type="application/json")


def build_app(host: HttpHost, *, auth_token: str | None = None, open_probes: bool = True) -> Starlette:
    """The ASGI app. With ``auth_token``, every route (probes too unless ``open_probes``)
    requires ``Authorization: Bearer <token>`` (scheme in any case; 401 without detail otherwise)."""

    def guarded(fn: Endpoint, *, probe: bool = False) -> Endpoint:
        if auth_token is None or (probe and open_probes):
            return fn
        token = auth_token

        async def check(request: Request) -> Response:
            if not bearer_matches(request.headers.get("authorization"), token):
                return Response(status_code=401)
            return await fn(request)

        return check

    async def health(request: Request) -> Response:
        return _json_response({"status": "alive"})

    async def ready(request: Request) -> Response:
        reason = host.not_ready_reason()
        if reason is None:
            return _json_response({"ready": True})
        return _json_response({"ready": False, "reason": reason}, 503)

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)

    async def worker(request: Request) -> Response:
        card = host.current_card()
        if card is None:
            return _json_response({"error": "engine not discovered yet"}, 503)
        return _json_response(card)

    async def load(request: Request) -> Response:
        return _json_response(host.load.status(now=trio.current_time()))

    async def schema(request: Request) -> Response:
        return Response(schema_json(), media_type="application/schema+json")

    async def not_here(websocket: WebSocket) -> None:
        await websocket.send_denial_response(
            PlainTextResponse(NOT_THE_WEBSOCKET_PORT, 400, headers={LISTENER_HEADER: "http"})
        )

    app = Starlette(
        routes=[
            Route("/health", guarded(health, probe=True)),
            Route("/ready", guarded(ready, probe=True)),
            Route("/metrics", guarded(metrics)),
            Route("/v1/worker", guarded(worker)),
            Route("/v1/load", guarded(load)),
            Route("/v1/schema", guarded(schema)),
            WebSocketRoute("/{path:path}", not_here),
        ]
    )
    app.router.redirect_slashes = False  # a redirect would name the client-supplied Host
    return app
