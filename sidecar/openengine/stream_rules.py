"""I/O-free checkers for the OpenEngine server-stream rules (schema "Standard errors" and
"Generation API" sections).

A checker sees each response in order and either accepts it, marks the stream terminal,
or raises :class:`EngineProtocolError`. The EngineClient runs one per stream, so a
misbehaving engine fails that stream alone, with a message naming the broken rule.
"""

from __future__ import annotations

from typing import Any

import betterproto2

from sidecar.openengine import pb
from sidecar.openengine.errors import EngineProtocolError, EngineTerminalError


def which_event(message: Any) -> tuple[str, Any]:
    """The name and value of a response's ``event`` oneof (``("", None)`` when unset)."""
    name, value = betterproto2.which_one_of(message, "event")
    return name, value


class GenerateRules:
    """Rules of one ``Generate`` stream.

    - every response carries exactly one event, and its ``request_id`` (when set) matches;
    - ``TokenOutput``/``GenerationFinished`` carry ``output_index`` in ``0..num_outputs-1``;
    - nothing for an index after its ``GenerationFinished``; nothing after a terminal
      (the last finish, ``PrefillReady`` or ``EngineError``);
    - ``PromptOutput`` at most once; ``Usage`` only on the final response;
    - the stream must not end OK before a terminal.

    ``observe`` returns the event name; an ``EngineError`` event raises
    :class:`EngineTerminalError` (after marking the stream terminal).
    """

    __slots__ = ("_finished", "_prompt_seen", "num_outputs", "request_id", "terminal")

    def __init__(self, request_id: str, num_outputs: int) -> None:
        self.request_id = request_id
        self.num_outputs = max(1, num_outputs)
        self._finished: set[int] = set()
        self._prompt_seen = False
        self.terminal = False

    @classmethod
    def for_request(cls, request: pb.GenerateRequest) -> GenerateRules:
        n = request.sampling.num_sequences if request.sampling is not None else None
        return cls(request.request_id, n or 1)

    def observe(self, resp: pb.GenerateResponse) -> str:
        if self.terminal:
            raise EngineProtocolError("engine sent an event after the stream's terminal event")
        if resp.request_id and self.request_id and resp.request_id != self.request_id:
            raise EngineProtocolError(
                f"engine sent request_id {resp.request_id!r} on the stream of {self.request_id!r}"
            )
        name, value = which_event(resp)
        final = False
        if name == "token":
            self._check_index(value.output_index, "TokenOutput")
        elif name == "finished":
            self._check_index(value.output_index, "GenerationFinished")
            self._finished.add(value.output_index)
            final = len(self._finished) == self.num_outputs
        elif name == "prompt":
            if self._prompt_seen:
                raise EngineProtocolError("engine sent PromptOutput twice")
            self._prompt_seen = True
        elif name == "prefill_ready":
            final = True
        elif name == "error":
            self.terminal = True
            raise EngineTerminalError(value, resp)
        else:
            raise EngineProtocolError("engine sent a GenerateResponse with no event")
        if resp.usage is not None and not final:
            raise EngineProtocolError(f"engine sent Usage on a non-final {name} event")
        self.terminal = final
        return name

    def _check_index(self, index: int | None, what: str) -> None:
        if index is None:
            raise EngineProtocolError(f"engine sent {what} without output_index")
        if index >= self.num_outputs:
            raise EngineProtocolError(
                f"engine sent {what} for output_index {index}; the request has {self.num_outputs} output(s)"
            )
        if index in self._finished:
            raise EngineProtocolError(f"engine sent {what} for output_index {index} after its finish")

    def check_end(self) -> None:
        """Called when the engine closed the stream OK: it must have reached a terminal."""
        if not self.terminal:
            raise EngineProtocolError("engine closed the Generate stream without a terminal event")


class DrainRules:
    """``Drain``: STARTED / IN_PROGRESS progress, then ``COMPLETE`` or one ``EngineError``."""

    __slots__ = ("terminal",)

    def __init__(self) -> None:
        self.terminal = False

    def observe(self, resp: pb.DrainResponse) -> None:
        if self.terminal:
            raise EngineProtocolError("engine sent a drain event after COMPLETE or an error")
        name, value = which_event(resp)
        if name == "error":
            self.terminal = True
            raise EngineTerminalError(value, resp)
        if name != "state":
            raise EngineProtocolError("engine sent a DrainResponse with no event")
        if value == pb.DrainState.COMPLETE:
            self.terminal = True

    def check_end(self) -> None:
        if not self.terminal:
            raise EngineProtocolError("engine closed the Drain stream before COMPLETE")


class KvEventRules:
    """``SubscribeKvEvents``: batches until an optional terminal ``EngineError``."""

    __slots__ = ("terminal",)

    def __init__(self) -> None:
        self.terminal = False

    def observe(self, resp: pb.SubscribeKvEventsResponse) -> None:
        if self.terminal:
            raise EngineProtocolError("engine sent a KV event after its terminal error")
        name, value = which_event(resp)
        if name == "error":
            self.terminal = True
            raise EngineTerminalError(value, resp)
        if name != "batch":
            raise EngineProtocolError("engine sent a SubscribeKvEventsResponse with no event")

    def check_end(self) -> None:
        """A KV subscription may end OK at any time (the subscriber resubscribes)."""
