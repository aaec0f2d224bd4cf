"""The KV bridge's trace spans (``run --otlp-endpoint``): each replay and each resync of a rank
is a root span of its own, so a router's cleared view can be matched to what the engine did.

- ``kv.replay``: from asking for the missing batches (a gap in a ZMQ stream, a resumed
  ``SubscribeKvEvents``) to their answer; attributes ``openengine.kv.rank``,
  ``openengine.kv.transport``, ``openengine.kv.replay.start``, ``openengine.kv.gap.missing``
  (numbers skipped; 0: joined late or resumed after an error), ``openengine.kv.replay.outcome``
  (``ok``, ``failed``, ``over_limit``) and ``openengine.kv.replay.batches``.
- ``kv.resync``: an ``AllBlocksCleared`` published, ``openengine.kv.resync.reason`` saying why.

With tracing off (no tracer) every method returns at once. A replay cut short by the bridge's
own stop is not exported.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sidecar.tracing.otel import Activity, AttributeValue, Tracer


class KvSpans:
    """The spans of one rank's ingest (module doc); ``tracer`` None: none."""

    __slots__ = ("_attrs", "_tracer")

    def __init__(self, tracer: Tracer | None, rank: int, transport: str) -> None:
        self._tracer = tracer
        self._attrs: dict[str, AttributeValue] = {
            "openengine.kv.rank": rank,
            "openengine.kv.transport": transport,
        }

    def replay(self, start: int, missing: int) -> Activity | None:
        """A ``kv.replay`` span from now; end it with :meth:`replayed`."""
        if self._tracer is None:
            return None
        return self._tracer.begin(
            "kv.replay",
            {**self._attrs, "openengine.kv.replay.start": start, "openengine.kv.gap.missing": missing},
        )

    @staticmethod
    def replayed(span: Activity | None, outcome: str, batches: int) -> None:
        """End a :meth:`replay` span with its outcome (status ERROR unless ``ok``)."""
        if span is None:
            return
        span.set("openengine.kv.replay.outcome", outcome)
        span.set("openengine.kv.replay.batches", batches)
        span.end(None if outcome == "ok" else f"replay {outcome}")

    def resync(self, reason: str) -> None:
        """A ``kv.resync`` span: ``AllBlocksCleared`` published for ``reason``."""
        if self._tracer is not None:
            self._tracer.begin("kv.resync", {**self._attrs, "openengine.kv.resync.reason": reason}).end()
