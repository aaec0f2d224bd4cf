"""HTTP endpoints: ``/health``, ``/ready``, ``/metrics``, ``/v1/worker``, ``/v1/load``.

A Starlette app served by hypercorn's trio worker inside the sidecar's nursery; no
hand-written HTTP. ``/health`` is liveness (the process and its event loop answer);
``/ready`` is 200 only when negotiated, discovered, engine healthy and not draining.
"""

from __future__ import annotations

import hmac
from typing import Any, Protocol

import msgspec
import trio
from hypercorn.config import Config
from hypercorn.trio import serve
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from sidecar.metrics import REGISTRY

_json = msgspec.json.Encoder()


class HttpHost(Protocol):
    """What the HTTP plane reads from the core (``sidecar.core.sidecar.Sidecar``)."""

    def not_ready_reason(self) -> str | None: ...

    def current_card(self) -> Any: ...

    @property
    def draining(self) -> bool: ...

    load: Any


def _json_response(body: Any, status: int = 200) -> Response:
    return Response(_json.encode(body), status_code=status, media_type="application/json")


def build_app(host: HttpHost, *, auth_token: str | None = None, open_probes: bool = True) -> Starlette:
    """The ASGI app. With ``auth_token``, every route (probes too unless ``open_probes``)
    requires ``Authorization: Bearer <token>`` (401 without detail otherwise)."""
    expected = f"Bearer {auth_token}".encode() if auth_token else None

    def guarded(fn: Any, *, probe: bool = False) -> Any:
        if expected is None or (probe and open_probes):
            return fn

        async def check(request: Request) -> Response:
            given = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(given, expected):
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

    return Starlette(
        routes=[
            Route("/health", guarded(health, probe=True)),
            Route("/ready", guarded(ready, probe=True)),
            Route("/metrics", guarded(metrics)),
            Route("/v1/worker", guarded(worker)),
            Route("/v1/load", guarded(load)),
        ]
    )


async def serve_http(
    app: Starlette,
    bind: str,
    *,
    certfile: str | None = None,
    keyfile: str | None = None,
    task_status: Any = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` on ``bind`` (``host:port``) until cancelled; ``task_status.started(port)``."""
    config = Config()
    config.bind = [bind]
    config.accesslog = None
    config.errorlog = None
    config.graceful_timeout = 1.0
    if certfile:
        config.certfile, config.keyfile = certfile, keyfile

    async def run(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        await serve(app, config, task_status=task_status)  # type: ignore[arg-type]

    async with trio.open_nursery() as nursery:
        binds = await nursery.start(run)
        task_status.started(int(str(binds[0]).rsplit(":", 1)[1]))
