"""Raw server streams: every message as the engine sent it, with no stream-rule checking.

:class:`~sidecar.openengine.client.EngineClient` validates each stream against the
schema's rules and raises :class:`~sidecar.openengine.errors.EngineProtocolError` at the
first violation. A conformance suite needs the opposite: observe everything the engine
sends (an event after a terminal, a second ``PromptOutput``, a missing ``output_index``)
and judge it afterwards. These open the same streams through the same client (same channels, codec,
cancellation and error translation) with ``checked=False``.

- An ``EngineError`` event is yielded like any other message (not raised).
- A non-OK status still raises :class:`~sidecar.openengine.errors.EngineStatusError`
  after the messages that preceded it; a lost connection
  :class:`~sidecar.openengine.errors.EngineUnavailable`.
- Leaving the ``async with`` block early resets the HTTP/2 stream at once, as with the
  checked streams.
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager

from sidecar.openengine import pb
from sidecar.openengine.client import EngineClient, EngineStream, MetadataLike

__all__ = ["raw_drain", "raw_generate", "raw_subscribe_kv_events"]


def raw_generate(
    client: EngineClient, request: pb.GenerateRequest, *, metadata: MetadataLike | None = None
) -> AbstractAsyncContextManager[EngineStream[pb.GenerateResponse]]:
    """``Generate`` without rule checks."""
    return client.generate(request, metadata=metadata, checked=False)


def raw_drain(
    client: EngineClient, request: pb.DrainRequest, *, metadata: MetadataLike | None = None
) -> AbstractAsyncContextManager[EngineStream[pb.DrainResponse]]:
    """``Drain`` without rule checks (errors included)."""
    return client.drain(request, metadata=metadata, checked=False)


def raw_subscribe_kv_events(
    client: EngineClient, request: pb.SubscribeKvEventsRequest, *, metadata: MetadataLike | None = None
) -> AbstractAsyncContextManager[EngineStream[pb.SubscribeKvEventsResponse]]:
    """``SubscribeKvEvents`` without rule checks."""
    return client.subscribe_kv_events(request, metadata=metadata, checked=False)
