"""The OpenAI front's ASGI app: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``,
``/metrics``; served by ``sidecar.north.http_server.serve_http`` on ``--openai-listen``.

A generation request goes through the same admission and stream lifecycle as the WebSocket
plane's: mapped (``request_map``), admitted by the core (``Sidecar.admit``: draining, capacity,
the worker card — what the engine did not advertise never reaches it), then run by
``Sidecar.run_stream`` in this request's task, which owns the stream's nursery:

- the response starts with the stream's first event, so a refusal by the engine before any
  event is still an HTTP error status (``api_errors``); after that, a failure is an SSE error
  event. The request id (``X-Request-Id`` if the client gave one, else the sidecar's) is the
  ``X-Request-Id`` response header and part of the response ``id``;
- a client that disconnects (ASGI ``http.disconnect``, watched by a task beside the stream) —
  also one the listener disconnected because it took nothing of a write for
  ``--stall-timeout`` (``HttpLimits.write_timeout``) — cancels the stream: the engine stream is
  closed and its ``Abort`` sent by the lifecycle, as for every plane. Events that arrived
  together leave in one write;
- drain: admission answers ``DRAINING`` (503, ``Retry-After``) while admitted requests finish;
  :meth:`OpenAIFront.close` makes every new request 503 and :meth:`OpenAIFront.wait_idle`
  returns once the last response has been written.

Limits (docs/SECURITY.md): the body (``max_body_bytes``, 413; it must arrive within
``body_timeout``, 408), the counts inside it (``protocol``), open requests per client address
(``max_streams_per_peer``, 429), and the listener's connections and headers (``HttpLimits``).
With ``auth_token`` every route needs ``Authorization: Bearer <token>`` (401).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import NotRequired, Protocol, TypedDict

import msgspec
import trio
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from sidecar.core.card import WorkerCard
from sidecar.core.errors import Rejection
from sidecar.core.lifecycle import COMPLETED, OUTCOME_CLIENT_GONE, ClientGone, Outcome, StreamHandle
from sidecar.metrics_registry import REGISTRY
from sidecar.north.auth import bearer_matches
from sidecar.north.openai import gie_metrics
from sidecar.north.openai.api_errors import ApiError, from_outcome
from sidecar.north.openai.chat_templates import ChatTemplate, load_chat_template
from sidecar.north.openai.protocol import BadRequest, ChatRequest, decode_chat, decode_completion
from sidecar.north.openai.request_map import MappedRequest, map_chat, map_completion, render_chat
from sidecar.north.openai.responses import DONE, ResponseBuilder, sse
from sidecar.north.peers import PeerLimits, peer_key
from sidecar.openengine import pb

__all__ = ["OpenAIConfig", "OpenAIFront", "OpenAIHost"]

log = logging.getLogger(__name__)

#: A chat body larger than this is rendered in a worker thread (the event loop goes on).
RENDER_INLINE_BYTES = 64 * 1024
#: Headers of the request read by the front (lower case).
_HEADERS = ("x-request-id", "traceparent", "tracestate", "authorization", "content-length")


class _ModelEntry(TypedDict):
    """One model of ``GET /v1/models`` (vLLM's fields: ``root``, ``parent``, ``max_model_len``)."""

    id: str
    object: str
    created: int
    owned_by: str
    root: str
    parent: str | None
    max_model_len: NotRequired[int]


class OpenAIHost(gie_metrics.MetricsHost, Protocol):
    """What the front needs from the core (``sidecar.core.sidecar.Sidecar``)."""

    def admit(
        self, request: pb.GenerateRequest, metadata: dict[str, str], *, kv_session_bytes: bytes | None = None
    ) -> StreamHandle: ...

    async def run_stream(
        self, handle: StreamHandle, emit: Callable[[pb.GenerateResponse], Awaitable[None]]
    ) -> Outcome: ...


@dataclass
class OpenAIConfig:
    """The front's limits (``run`` flags: ``--max-message-size``, ``--handshake-timeout``,
    ``--peer-stream-share``, ``--auth-token-file``, ``--chat-template``)."""

    auth_token: str | None = None
    max_body_bytes: int = 4 * 1024 * 1024
    body_timeout: float = 10.0
    max_streams_per_peer: int = 0
    chat_template: str | None = None


class _Endpoint:
    """An ASGI endpoint of the front (Starlette passes non-function endpoints the raw ASGI call)."""

    def __init__(self, handler: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self.handler = handler

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.handler(scope, receive, send)


async def _send_error(send: Send, err: ApiError, request_id: str | None = None) -> None:
    headers = err.headers()
    if request_id:
        headers.append((b"x-request-id", request_id.encode()))
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": err.encode()})


def _headers(scope: Scope) -> dict[str, str]:
    out: dict[str, str] = {}
    for name, value in scope["headers"]:
        key = name.decode("latin-1").lower()
        if key in _HEADERS:
            out[key] = value.decode("latin-1")
    return out


def _rejection(rejection: Rejection) -> ApiError:
    return from_outcome(Outcome.from_rejection(rejection))


class OpenAIFront:
    """The front of one sidecar: its templates, its in-flight requests, its app (module doc)."""

    def __init__(self, host: OpenAIHost, config: OpenAIConfig | None = None) -> None:
        self.host = host
        self.config = config or OpenAIConfig()
        self.templates: dict[str, ChatTemplate | None] = {}
        self.limits = PeerLimits(max_streams_per_peer=self.config.max_streams_per_peer)
        self.started = int(time.time())
        self._active = 0
        self._idle = trio.Event()
        self._idle.set()
        self._closed = False
        gie_metrics.install(host)

    # -- templates -------------------------------------------------------------------------

    async def load_templates(self) -> None:
        """Find every served model's chat template (blocking file I/O, in a worker thread);
        log which each model uses."""
        card = self.host.card
        if card is None:
            return
        for model in card.models:
            source = (model.tokenizer.source if model.tokenizer is not None else None) or model.model_id
            template = await trio.to_thread.run_sync(
                load_chat_template, source or "", self.config.chat_template
            )
            self.templates[model.served_model_name] = template
            if template is None:
                log.warning(
                    "model %s: no chat template (tokenizer %s); /v1/chat/completions refuses it until "
                    "one is given with --chat-template FILE",
                    model.served_model_name,
                    source or "not advertised",
                )
            else:
                log.info("model %s: chat template from %s", model.served_model_name, template.origin)

    # -- lifecycle -------------------------------------------------------------------------

    def close(self) -> None:
        """Answer every new request 503 from now on (requests in progress go on)."""
        self._closed = True

    async def wait_idle(self) -> None:
        """Return once no request is in progress."""
        while self._active:
            await self._idle.wait()

    # -- the app ---------------------------------------------------------------------------

    def app(self) -> ASGIApp:
        """The ASGI app: the generation endpoints directly (no middleware on their path, their
        errors are answered by the endpoints themselves), everything else through Starlette."""
        routed = self._routed()
        completions, chat = self._completions, self._chat

        async def app(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] == "http" and scope["method"] == "POST":
                path = scope["path"]
                if path == "/v1/completions":
                    return await completions(scope, receive, send)
                if path == "/v1/chat/completions":
                    return await chat(scope, receive, send)
            await routed(scope, receive, send)

        return app

    def _routed(self) -> Starlette:
        async def not_found(request: Request, exc: Exception) -> Response:
            status = getattr(exc, "status_code", 404)
            err = ApiError(
                status,
                f"{request.method} {request.url.path}: not found" if status == 404 else "method not allowed",
            )
            return Response(err.encode(), status, media_type="application/json")

        app = Starlette(
            routes=[
                Route("/v1/models", self._guard(self._models), methods=["GET"]),
                Route("/v1/completions", _Endpoint(self._completions), methods=["POST"]),
                Route("/v1/chat/completions", _Endpoint(self._chat), methods=["POST"]),
                Route("/metrics", self._guard(self._metrics), methods=["GET"]),
            ],
            exception_handlers={404: not_found, 405: not_found},
        )
        app.router.redirect_slashes = False
        return app

    def _authorized(self, header: str | None) -> bool:
        token = self.config.auth_token
        return token is None or bearer_matches(header, token)

    def _guard(
        self, fn: Callable[[Request], Awaitable[Response]]
    ) -> Callable[[Request], Awaitable[Response]]:
        async def guarded(request: Request) -> Response:
            if not self._authorized(request.headers.get("authorization")):
                err = ApiError(401, "a valid bearer token is required")
                return Response(err.encode(), 401, media_type="application/json")
            return await fn(request)

        return guarded

    async def _metrics(self, request: Request) -> Response:
        return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)

    async def _models(self, request: Request) -> Response:
        card = self.host.card
        data: list[_ModelEntry] = []
        if card is not None:
            for m in card.models:
                for name in m.names:
                    data.append(
                        self._model_entry(name, m.model_id or m.served_model_name, None, m.max_context_length)
                    )
            for a in card.lora_adapters or ():
                if a.base_model is not None:
                    data.append(self._model_entry(a.lora_name, a.source_path, a.base_model, None))
        body = _json({"object": "list", "data": data})
        return Response(body, media_type="application/json")

    def _model_entry(self, name: str, root: str, parent: str | None, max_len: int | None) -> _ModelEntry:
        entry: _ModelEntry = {
            "id": name,
            "object": "model",
            "created": self.started,
            "owned_by": "openengine-sidecar",
            "root": root,
            "parent": parent,
        }
        if max_len is not None:
            entry["max_model_len"] = max_len
        return entry

    async def _completions(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._generate(scope, receive, send, chat=False)

    async def _chat(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._generate(scope, receive, send, chat=True)

    async def _generate(self, scope: Scope, receive: Receive, send: Send, *, chat: bool) -> None:
        self._active += 1
        if self._idle.is_set():
            self._idle = trio.Event()
        try:
            await self._answer(scope, receive, send, chat=chat)
        except ClientGone:
            pass
        finally:
            self._active -= 1
            if not self._active:
                self._idle.set()

    async def _answer(self, scope: Scope, receive: Receive, send: Send, *, chat: bool) -> None:
        headers = _headers(scope)
        try:
            if not self._authorized(headers.get("authorization")):
                raise ApiError(401, "a valid bearer token is required")
            if self._closed:
                raise ApiError(503, "the sidecar is shutting down", code="draining")
            body = await read_body(receive, self.config, headers.get("content-length"))
            card = self.host.card
            if card is None:
                raise ApiError(503, "engine not discovered yet", code="internal")
            mapped = await self._map(body, card, headers, chat=chat)
        except ApiError as err:
            await _send_error(send, err)
            return
        except BadRequest as err:
            await _send_error(send, ApiError(400, err.message, err.param))
            return
        except Rejection as rejection:
            await _send_error(send, _rejection(rejection))
            return
        peer = peer_key(scope.get("client"))
        if not self.limits.open_stream(peer):
            limit = self.limits.max_streams_per_peer
            await _send_error(
                send, ApiError(429, f"at most {limit} open requests per client address", code="overloaded")
            )
            return
        try:
            try:
                handle = self.host.admit(mapped.request, mapped.metadata)
            except Rejection as rejection:
                await _send_error(send, _rejection(rejection), mapped.request.request_id)
                return
            await _Exchange(self.config, handle, mapped, chat, receive, send).run(self.host)
        finally:
            self.limits.close_stream(peer)

    async def _map(
        self, body: bytes, card: WorkerCard, headers: dict[str, str], *, chat: bool
    ) -> MappedRequest:
        if not chat:
            return map_completion(decode_completion(body), card, headers)
        req: ChatRequest = decode_chat(body)
        mapped, template, mm = map_chat(req, card, headers, self.templates.get)
        if len(body) > RENDER_INLINE_BYTES:
            prompt, media = await trio.to_thread.run_sync(render_chat, req, template, mm)
        else:
            prompt, media = render_chat(req, template, mm)
        mapped.request.prompt = prompt
        mapped.request.media = media
        return mapped


async def read_body(receive: Receive, config: OpenAIConfig, content_length: str | None) -> bytes:
    """The request's body: at most ``max_body_bytes`` (413), within ``body_timeout`` (408);
    ``ClientGone`` if the client leaves first. Complete once its ``Content-Length`` (validated by
    the HTTP parser) has arrived: the ASGI end-of-body message that follows is left to the
    disconnect watch, which ignores it (the request goes on one scheduler pass sooner)."""
    limit = config.max_body_bytes
    length = int(content_length) if content_length is not None and content_length.isdigit() else -1
    chunks: list[bytes] = []
    size = 0
    with trio.move_on_after(config.body_timeout):
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientGone
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise ApiError(413, f"the request body is larger than {limit} bytes")
            chunks.append(chunk)
            if size == length or not message.get("more_body", False):
                return b"".join(chunks)
    raise ApiError(408, f"the request body did not arrive within {config.body_timeout:g}s")


_json = msgspec.json.Encoder().encode


class _Exchange:
    """One admitted request's response: the stream, the disconnect watch, the writes."""

    def __init__(
        self,
        config: OpenAIConfig,
        handle: StreamHandle,
        mapped: MappedRequest,
        chat: bool,
        receive: Receive,
        send: Send,
    ) -> None:
        self.config = config
        self.handle = handle
        self.mapped = mapped
        self.receive = receive
        self.send = send
        self.started = False
        self.gone = False
        #: SSE chunks held for one write (events that arrived together).
        self.pending: list[bytes] = []
        self.builder = ResponseBuilder(
            chat=chat,
            request_id=handle.request_id,
            model=mapped.model,
            n=mapped.n,
            logprobs=mapped.logprobs,
            stream=mapped.stream,
        )

    async def _watch(self) -> None:
        """While the stream runs: a disconnect cancels it (also the listener's close of a
        connection whose client took nothing of a write for ``--stall-timeout``); other messages
        (the end of a body read by its length) are ignored."""
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                self.gone = True
                self.handle.cancel(OUTCOME_CLIENT_GONE)
                return

    async def _start(
        self, status: int, content_type: bytes, extra: Sequence[tuple[bytes, bytes]] = ()
    ) -> None:
        headers = [
            (b"content-type", content_type),
            (b"x-request-id", self.handle.request_id.encode()),
            *extra,
        ]
        await self._send({"type": "http.response.start", "status": status, "headers": headers})
        self.started = True

    async def _send(self, message: dict[str, object]) -> None:
        """One ASGI send; ``ClientGone`` once the client is gone."""
        if self.gone:
            raise ClientGone
        try:
            await self.send(message)
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
            self.gone = True
            raise ClientGone from None

    async def _write(self, data: bytes) -> None:
        await self._send({"type": "http.response.body", "body": data, "more_body": True})

    async def _begin(self) -> None:
        """Start the event stream (its headers; the opening chunks go first)."""
        await self._start(200, b"text/event-stream", [(b"cache-control", b"no-cache")])
        self.pending[:0] = self.builder.opening()

    async def _flush(self) -> None:
        """Start the event stream if not yet, and write the chunks held back."""
        if not self.started:
            await self._begin()
        if self.pending:
            data = b"".join(self.pending)
            self.pending.clear()
            await self._write(data)

    async def _emit_stream(self, ev: pb.GenerateResponse) -> None:
        chunk = self.builder.event(ev)
        if chunk is None:
            return
        self.pending.append(chunk)
        # events that came together leave in one write; the last one (it carries the usage)
        # leaves with the end of the response
        if ev.usage is None and not self.handle.more_queued:
            await self._flush()

    async def _emit_whole(self, ev: pb.GenerateResponse) -> None:
        self.builder.event(ev)

    async def run(self, host: OpenAIHost) -> None:
        """Run the stream with the disconnect watch beside it, then write the response's end.
        The end is written after the watch has ended, so that nothing of this request is left
        to finish once the client has it: a keep-alive client's next request is read at once.
        A client lost during the end's write fails that write (``ClientGone``); one that takes
        nothing is closed by the listener's ``--stall-timeout``."""
        emit = self._emit_stream if self.mapped.stream else self._emit_whole
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._watch)
            outcome = await host.run_stream(self.handle, emit)
            nursery.cancel_scope.cancel()
        if self.gone:
            return
        if outcome.kind == COMPLETED:
            await self._finish()
        else:
            await self._fail(from_outcome(outcome))

    async def _finish(self) -> None:
        b = self.builder
        if not self.mapped.stream:
            await self._start(200, b"application/json")
            await self._send({"type": "http.response.body", "body": _json(b.body())})
            return
        if self.mapped.include_usage:
            self.pending.append(b.usage_chunk())
        if not self.started:
            await self._begin()
        self.pending.append(DONE)
        await self._send({"type": "http.response.body", "body": b"".join(self.pending)})

    async def _fail(self, err: ApiError) -> None:
        if not self.started:
            headers = err.headers()
            await self._start(err.status, b"application/json", headers[1:])
            await self._send({"type": "http.response.body", "body": err.encode()})
            return
        self.pending += [sse(err.body()), DONE]
        await self._send({"type": "http.response.body", "body": b"".join(self.pending)})
