"""I/O-free checkers for the OpenEngine server-stream rules (schema "Standard errors" and
"Generation API" sections), and the names of every rule the sidecar fails a stream for.

A checker sees each response in order and either accepts it, marks the stream terminal,
or raises :class:`StreamRuleError`. The EngineClient runs one per stream, so a
misbehaving engine fails that stream alone, with a message naming the broken rule and the
conformance check that tests an engine for it.

:class:`Violation` names each way an engine's stream can break a rule the serving path
enforces — the checkers' rules here, and what the Generate relay (``sidecar.core.lifecycle``)
and the KV bridge's decoders refuse — and :data:`CONFORMANCE_CHECKS` maps each to the check
of ``openengine-sidecar conformance`` (docs/CONFORMANCE.md) that fails an engine breaking it
(tests/conformance/test_coverage.py keeps the two in step).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Final

import betterproto2

from sidecar.openengine import pb
from sidecar.openengine.engine_errors import (
    EngineClientError,
    EngineProtocolError,
    EngineStatusError,
    EngineTerminalError,
    EngineUnavailable,
)


class Violation(enum.Enum):
    """A rule of an engine's stream the serving path fails the stream (or its data) for."""

    # Generate: GenerateRules
    REQUEST_ID = "generate-request-id"
    """A response names another request's ``request_id``."""
    NO_EVENT = "generate-no-event"
    """A response carries no event (none set, or one this schema does not know)."""
    AFTER_TERMINAL = "generate-after-terminal"
    """An event after the stream's terminal (the last finish or ``PrefillReady``)."""
    AFTER_FINISH = "generate-after-finish"
    """An event for an output after its ``GenerationFinished``."""
    NO_OUTPUT_INDEX = "generate-no-output-index"
    """``TokenOutput`` / ``GenerationFinished`` without ``output_index``."""
    OUTPUT_INDEX_RANGE = "generate-output-index-range"
    """``output_index`` not below the request's ``num_sequences``."""
    PROMPT_TWICE = "generate-prompt-twice"
    """A second ``PromptOutput``."""
    USAGE_NOT_FINAL = "generate-usage-not-final"
    """``Usage`` on a response that is not the final one."""
    NO_TERMINAL = "generate-no-terminal"
    """The call closed OK before a terminal event."""
    # Generate: the relay (sidecar.core.lifecycle), by :func:`violation_of`
    STATUS_AFTER_ACCEPTANCE = "generate-status-after-acceptance"
    """A non-OK gRPC status after the first event (a failure after acceptance is one ``EngineError``)."""
    LOST_AFTER_ACCEPTANCE = "generate-lost-after-acceptance"
    """The call was reset or its connection lost after the first event."""
    UNREADABLE = "generate-unreadable"
    """A message the client cannot take: undecodable, compressed without negotiation, cut
    short, or over the client's size bound (``--engine-max-event-bytes``, default 4 MiB)."""
    SILENT = "generate-silent"
    """No event, nor the call's close, within ``--first-event-timeout`` /
    ``--inactivity-timeout`` (a stream left open after its terminal event included)."""
    # Drain: DrainRules
    DRAIN_AFTER_TERMINAL = "drain-after-terminal"
    """A Drain event after ``COMPLETE`` or an ``EngineError``."""
    DRAIN_NO_EVENT = "drain-no-event"
    """A ``DrainResponse`` with no event."""
    DRAIN_NO_COMPLETE = "drain-no-complete"
    """The Drain call closed OK before ``COMPLETE``."""
    # SubscribeKvEvents: KvEventRules, and the KV bridge's decoders (sidecar.kvbridge)
    KV_AFTER_ERROR = "kv-after-error"
    """A KV event after the subscription's terminal ``EngineError``."""
    KV_NO_EVENT = "kv-no-event"
    """A ``SubscribeKvEventsResponse`` with no event."""
    KV_UNDECODABLE = "kv-undecodable"
    """A batch the KV bridge cannot decode (``KvDecodeError``: an event with none set, an empty or
    malformed block hash, a ZMQ message that is not a batch): it is dropped and its rank resynced."""

    @property
    def check(self) -> str:
        """The conformance check that fails an engine breaking this rule."""
        return CONFORMANCE_CHECKS[self]


#: Each :class:`Violation` -> the id of the conformance check that covers it.
CONFORMANCE_CHECKS: Final[Mapping[Violation, str]] = MappingProxyType(
    {
        Violation.REQUEST_ID: "generate.request-id",
        Violation.NO_EVENT: "generate.one-event",
        Violation.AFTER_TERMINAL: "generate.nothing-after-finish",
        Violation.AFTER_FINISH: "generate.nothing-after-finish",
        Violation.NO_OUTPUT_INDEX: "generate.output-index",
        Violation.OUTPUT_INDEX_RANGE: "generate.output-index",
        Violation.PROMPT_TWICE: "generate.prompt-once",
        Violation.USAGE_NOT_FINAL: "generate.usage-final",
        Violation.NO_TERMINAL: "generate.one-finish",
        Violation.STATUS_AFTER_ACCEPTANCE: "generate.closes-ok",
        Violation.LOST_AFTER_ACCEPTANCE: "generate.closes-ok",
        Violation.SILENT: "generate.closes-ok",
        Violation.UNREADABLE: "generate.wire-format",
        Violation.DRAIN_AFTER_TERMINAL: "drain.progress",
        Violation.DRAIN_NO_EVENT: "drain.progress",
        Violation.DRAIN_NO_COMPLETE: "drain.progress",
        Violation.KV_AFTER_ERROR: "kv.well-formed",
        Violation.KV_NO_EVENT: "kv.well-formed",
        Violation.KV_UNDECODABLE: "kv.well-formed",
    }
)


class StreamRuleError(EngineProtocolError):
    """The engine broke the stream rule ``violation``; the message ends with the conformance
    check that covers it."""

    def __init__(self, violation: Violation, message: str) -> None:
        super().__init__(f"{message} (conformance check {violation.check})")
        self.violation = violation


def violation_of(err: EngineClientError) -> Violation | None:
    """The rule an accepted Generate stream broke when it failed with ``err`` (None: none —
    an ``EngineError`` event is the engine's own verdict, not a broken rule)."""
    if isinstance(err, StreamRuleError):
        return err.violation
    if isinstance(err, EngineProtocolError):
        return Violation.UNREADABLE
    if isinstance(err, EngineStatusError):
        return Violation.STATUS_AFTER_ACCEPTANCE
    if isinstance(err, EngineUnavailable):
        return Violation.LOST_AFTER_ACCEPTANCE
    return None


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
    :class:`EngineTerminalError` (after marking the stream terminal); a broken rule raises
    :class:`StreamRuleError`.
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
            raise StreamRuleError(
                Violation.AFTER_TERMINAL, "engine sent an event after the stream's terminal event"
            )
        if resp.request_id and self.request_id and resp.request_id != self.request_id:
            raise StreamRuleError(
                Violation.REQUEST_ID,
                f"engine sent request_id {resp.request_id!r} on the stream of {self.request_id!r}",
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
                raise StreamRuleError(Violation.PROMPT_TWICE, "engine sent PromptOutput twice")
            self._prompt_seen = True
        elif name == "prefill_ready":
            final = True
        elif name == "error":
            self.terminal = True
            raise EngineTerminalError(value, resp)
        else:
            raise StreamRuleError(Violation.NO_EVENT, "engine sent a GenerateResponse with no event")
        if resp.usage is not None and not final:
            raise StreamRuleError(Violation.USAGE_NOT_FINAL, f"engine sent Usage on a non-final {name} event")
        self.terminal = final
        return name

    def _check_index(self, index: int | None, what: str) -> None:
        if index is None:
            raise StreamRuleError(Violation.NO_OUTPUT_INDEX, f"engine sent {what} without output_index")
        if index >= self.num_outputs:
            raise StreamRuleError(
                Violation.OUTPUT_INDEX_RANGE,
                f"engine sent {what} for output_index {index}; the request has {self.num_outputs} output(s)",
            )
        if index in self._finished:
            raise StreamRuleError(
                Violation.AFTER_FINISH, f"engine sent {what} for output_index {index} after its finish"
            )

    def check_end(self) -> None:
        """Called when the engine closed the stream OK: it must have reached a terminal."""
        if not self.terminal:
            raise StreamRuleError(
                Violation.NO_TERMINAL, "engine closed the Generate stream without a terminal event"
            )


class DrainRules:
    """``Drain``: STARTED / IN_PROGRESS progress, then ``COMPLETE`` or one ``EngineError``."""

    __slots__ = ("terminal",)

    def __init__(self) -> None:
        self.terminal = False

    def observe(self, resp: pb.DrainResponse) -> None:
        if self.terminal:
            raise StreamRuleError(
                Violation.DRAIN_AFTER_TERMINAL, "engine sent a drain event after COMPLETE or an error"
            )
        name, value = which_event(resp)
        if name == "error":
            self.terminal = True
            raise EngineTerminalError(value, resp)
        if name != "state":
            raise StreamRuleError(Violation.DRAIN_NO_EVENT, "engine sent a DrainResponse with no event")
        if value == pb.DrainState.COMPLETE:
            self.terminal = True

    def check_end(self) -> None:
        if not self.terminal:
            raise StreamRuleError(
                Violation.DRAIN_NO_COMPLETE, "engine closed the Drain stream before COMPLETE"
            )


class KvEventRules:
    """``SubscribeKvEvents``: batches until an optional terminal ``EngineError``."""

    __slots__ = ("terminal",)

    def __init__(self) -> None:
        self.terminal = False

    def observe(self, resp: pb.SubscribeKvEventsResponse) -> None:
        if self.terminal:
            raise StreamRuleError(Violation.KV_AFTER_ERROR, "engine sent a KV event after its terminal error")
        name, value = which_event(resp)
        if name == "error":
            self.terminal = True
            raise EngineTerminalError(value, resp)
        if name != "batch":
            raise StreamRuleError(
                Violation.KV_NO_EVENT, "engine sent a SubscribeKvEventsResponse with no event"
            )

    def check_end(self) -> None:
        """A KV subscription may end OK at any time (the subscriber resubscribes)."""
