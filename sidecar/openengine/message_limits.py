"""What the client takes from the engine: a size bound per kind of message, and where a
message is decoded.

The engine is trusted for what its messages say, not for their sizes (docs/SECURITY.md,
"Engine"). Every message the :class:`~sidecar.openengine.client.EngineClient` receives is
checked against its kind's bound from the gRPC length prefix, before a byte of it is kept
(:class:`sidecar.openengine.transport.grpc_framing.MessageReader`): over it, the call fails with
:class:`~sidecar.openengine.engine_errors.EngineMessageTooLarge`.

Decoding is CPU work proportional to the size (betterproto2: ~1 µs per byte): a message up to
``decode_inline_bytes`` is decoded on the event loop (a token event costs no thread hop); a
larger one in a worker thread (:func:`run_sized`), at most ``decode_threads`` at once per
client, so a large KV batch or answer cannot stall every relayed token. The thread shares the
GIL with the event loop, which still gets it every few milliseconds.
"""

from __future__ import annotations

from collections.abc import Callable, Sized
from dataclasses import dataclass
from typing import TypeVar

import trio

__all__ = ["EngineLimits", "run_sized"]

T = TypeVar("T")
D = TypeVar("D", bound=Sized)

MIB = 1024 * 1024


@dataclass(frozen=True)
class EngineLimits:
    """Bounds on what one engine client receives (CLI: ``--engine-max-event-bytes``,
    ``--engine-max-answer-bytes``; KV batches: ``--kv-max-batch-bytes``, given per call)."""

    max_event_bytes: int = 4 * MIB
    """Largest ``Generate`` event (gRPC's own default receive limit: an engine that fits any
    default gRPC client fits)."""
    max_answer_bytes: int = 4 * MIB
    """Largest answer of a unary ``Control`` call and largest ``Drain`` event."""
    max_kv_batch_bytes: int = 4 * MIB
    """Largest ``SubscribeKvEvents`` message when the caller gives no bound of its own."""
    decode_inline_bytes: int = 16 * 1024
    """Messages up to this size are decoded on the event loop (~16 ms at most), larger ones
    in a worker thread."""
    decode_threads: int = 2
    """Worker threads decoding large messages at once (per client; more wait their turn)."""


async def run_sized(
    fn: Callable[[D], T], data: D, *, inline_max: int, limiter: trio.CapacityLimiter | None = None
) -> T:
    """``fn(data)``: here when ``len(data) <= inline_max``, else in a worker thread (``limiter``
    bounds those; trio's default one when None).

    Cancellation abandons the thread: the caller goes on at once, the thread finishes its
    work and only then gives its ``limiter`` token back. Exceptions of ``fn`` propagate.
    """
    if len(data) <= inline_max:
        return fn(data)
    return await trio.to_thread.run_sync(fn, data, abandon_on_cancel=True, limiter=limiter)
