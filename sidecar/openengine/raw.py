"""Raw server streams: every message as the engine sent it, with no stream-rule checking.

:class:`~sidecar.openengine.client.EngineClient` validates each stream against the
schema's rules and raises :class:`~sidecar.openengine.errors.EngineProtocolError` at the
first violation. A conformance suite needs the opposite: observe everything the engine
sends (an event after a terminal, a second ``PromptOutput``, a missing ``output_index``)
and judge it afterwards. These helpers open the same streams through the same client
(same channels, codec, cancellation and error translation) with a no-op rule checker.

- An ``EngineError`` event is yielded like any other message (not raised).
- A non-OK status still raises :class:`~sidecar.openengine.errors.EngineStatusError`
  after the messages that preceded it; a lost connection
  :class:`~sidecar.openengine.errors.EngineUnavailable`.
- Leaving the ``async with`` block early resets the HTTP/2 stream at once, as with the
  checked streams.
"""

from __future__ import annotations

from typing import Any

from sidecar.openengine import pb
from sidecar.openengine.client import EngineClient, MetadataLike

__all__ = ["raw_drain", "raw_generate", "raw_subscribe_kv_events"]

_INFERENCE = "/openengine.v1.Inference/"
_CONTROL = "/openengine.v1.Control/"


class _NoRules:
    """A rule checker that accepts everything and never marks the stream terminal."""

    __slots__ = ("terminal",)

    def __init__(self) -> None:
        self.terminal = False

    def observe(self, resp: Any) -> None:
        return None

    def check_end(self) -> None:
        return None


def raw_generate(
    client: EngineClient, request: pb.GenerateRequest, *, metadata: MetadataLike | None = None
) -> Any:
    """``Generate`` without rule checks (async context manager yielding ``pb.GenerateResponse``)."""
    return client._server_stream(
        _INFERENCE + "Generate",
        request,
        request,
        pb.GenerateResponse,
        _NoRules(),
        metadata,
        client._pick_generate,
        request.request_id,
    )


def raw_drain(client: EngineClient, request: pb.DrainRequest, *, metadata: MetadataLike | None = None) -> Any:
    """``Drain`` without rule checks (yields ``pb.DrainResponse``, errors included)."""
    return client._server_stream(
        _CONTROL + "Drain",
        request,
        request,
        pb.DrainResponse,
        _NoRules(),
        metadata,
        lambda: (client._control_channel(), lambda: None),
    )


def raw_subscribe_kv_events(
    client: EngineClient, request: pb.SubscribeKvEventsRequest, *, metadata: MetadataLike | None = None
) -> Any:
    """``SubscribeKvEvents`` without rule checks (yields ``pb.SubscribeKvEventsResponse``)."""
    return client._server_stream(
        _CONTROL + "SubscribeKvEvents",
        request,
        request,
        pb.SubscribeKvEventsResponse,
        _NoRules(),
        metadata,
        lambda: (client._kv_channel(), lambda: None),
    )
