"""The records of a P/D flow (``sidecar.client.disagg``): what the caller iterates and reads.

:class:`DisaggFlow` is the caller's handle (decode events, then :class:`FlowEnd`);
:class:`Attempt` lists every sidecar a flow tried; :class:`DisaggError` is ``check()``'s error.
:class:`Worker`, :class:`Side` and :class:`FlowOver` are the coordinator's internal state.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec
import trio

from sidecar.client.sidecar_client import SidecarClient, SidecarConnectionError, SidecarError, SidecarStream
from sidecar.north import wire
from sidecar.openengine import pb
from sidecar.openengine.engine_errors import wire_name

__all__ = ["Attempt", "DisaggError", "DisaggFlow", "FlowEnd"]

Role = Literal["prefill", "decode"]


class Attempt(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One sidecar the flow tried: ``result`` is ``unreachable`` (no connection or no answer to
    ``describe``), ``unusable`` (its card does not fit), ``lost`` (connection lost mid-stream), or
    the ``end`` outcome of its stream (``completed``, ``rejected``, ``failed``, ``cancelled``)."""

    role: str
    url: str
    result: str
    code: str | None = None
    message: str = ""
    #: The same request may succeed there later (unreachable, lost, or a retryable error).
    retryable: bool = False


class FlowEnd(msgspec.Struct, kw_only=True, rename="camel"):
    """How a flow ended. ``outcome`` uses the ``end`` vocabulary: ``completed``, ``cancelled``,
    ``failed`` (after a sidecar accepted it), ``rejected`` (nothing served it)."""

    outcome: str
    error: wire.ErrorBody | None = None
    mode: str | None = None
    prefill: str | None = None
    decode: str | None = None
    #: Client-bootstrap room (a decimal string: it may exceed 2^53).
    room: str | None = None
    attempts: list[Attempt] = msgspec.field(default_factory=list)


class DisaggError(SidecarError):
    """``DisaggFlow.check()`` of a flow that did not complete (``code`` is an ``ERROR_CODE_*`` name)."""

    def __init__(self, end: FlowEnd) -> None:
        error = end.error
        detail = f"{error.code}: {error.message}" if error is not None else "no error details"
        super().__init__(f"P/D flow {end.outcome}: {detail}")
        self.end = end
        self.outcome = end.outcome
        self.code = error.code if error is not None else None
        self.message = error.message if error is not None else ""
        self.retryable = error.retryable if error is not None else False


class FlowOver(Exception):
    """Internal: the flow ends now with ``end``."""

    def __init__(self, end: FlowEnd) -> None:
        self.end = end


def error_body(code: pb.ErrorCode | str, message: str, retryable: bool = False) -> wire.ErrorBody:
    name = code if isinstance(code, str) else wire_name(code)
    return wire.ErrorBody(code=name, message=message, retryable=retryable)


@dataclass
class Worker:
    url: str
    client: SidecarClient
    card: dict[str, Any]


@dataclass
class Side:
    """One side's stream within a flow."""

    role: Role
    worker: Worker
    stream: SidecarStream | None = None
    events: int = 0
    lost: SidecarConnectionError | None = None
    problem: str | None = None  # a completed prefill whose handoff is unusable
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    done: trio.Event = field(default_factory=trio.Event)

    @property
    def end(self) -> wire.End | None:
        return self.stream.end if self.stream is not None else None

    @property
    def ok(self) -> bool:
        end = self.end
        return self.problem is None and self.lost is None and end is not None and end.outcome == "completed"

    @property
    def skippable(self) -> bool:
        """Failed in a way the next candidate may fix, before the caller saw anything of it."""
        if self.role == "decode" and self.events:
            return False
        if self.lost is not None:
            return True
        end = self.end
        if end is None or end.error is None or not end.error.retryable or self.problem is not None:
            return False
        return end.outcome == "rejected" or (self.role == "prefill" and end.outcome == "failed")

    def attempt(self) -> Attempt:
        url = self.worker.url
        if self.lost is not None:
            return Attempt(
                role=self.role,
                url=url,
                result="lost",
                code="ERROR_CODE_INTERNAL",
                message=str(self.lost),
                retryable=True,
            )
        end = self.end
        if end is None:
            return Attempt(
                role=self.role, url=url, result="cancelled", message="cancelled before it was sent"
            )
        if self.problem is not None:
            return Attempt(
                role=self.role, url=url, result="failed", code="ERROR_CODE_INTERNAL", message=self.problem
            )
        error = end.error
        return Attempt(
            role=self.role,
            url=url,
            result=end.outcome,
            code=error.code if error else None,
            message=error.message if error else "",
            retryable=error.retryable if error else False,
        )

    def error(self) -> wire.ErrorBody:
        if self.lost is not None:
            return error_body(
                pb.ErrorCode.INTERNAL, f"{self.role} sidecar {self.worker.url}: {self.lost}", True
            )
        if self.problem is not None:
            return error_body(pb.ErrorCode.INTERNAL, f"{self.role} sidecar {self.worker.url}: {self.problem}")
        end = self.end
        if end is not None and end.error is not None:
            e = end.error
            return wire.ErrorBody(code=e.code, message=f"{self.role}: {e.message}", retryable=e.retryable)
        return error_body(
            pb.ErrorCode.INTERNAL, f"{self.role} ended {end.outcome if end else 'without an end'}"
        )


class DisaggFlow:
    """One P/D generation: iterate it for the decode's ``wire.Event``s; ``end`` once it ended.

    Also: ``mode`` (``context_first`` / ``bootstrap``), ``prefill_url``, ``decode_url``,
    ``prefill_events`` (the prefill's events, ``prefillReady`` last), ``kv_session_bytes``
    (the handoff the decode received), ``room``, ``attempts``.
    """

    def __init__(self, request: pb.GenerateRequest, metadata: Mapping[str, str] | None, buffer: int) -> None:
        self.request = request
        self.metadata = dict(metadata) if metadata else None
        self.end: FlowEnd | None = None
        self.mode: str | None = None
        self.prefill_url: str | None = None
        self.decode_url: str | None = None
        self.prefill_events: list[wire.Event] = []
        self.kv_session_bytes: bytes | None = None
        self.room: int | None = None
        self.attempts: list[Attempt] = []
        self._send, self._recv = trio.open_memory_channel[wire.Event](buffer)

    def __aiter__(self) -> DisaggFlow:
        return self

    async def __anext__(self) -> wire.Event:
        try:
            return await self._recv.receive()
        except trio.EndOfChannel:
            raise StopAsyncIteration from None

    async def wait_end(self) -> FlowEnd:
        """Skip the remaining events and return the end."""
        async for _ in self:
            pass
        assert self.end is not None
        return self.end

    def check(self) -> FlowEnd:
        """The end if ``completed``, else raise :class:`DisaggError`. Call after the flow ended."""
        if self.end is None:
            raise RuntimeError("the flow has not ended yet")
        if self.end.outcome != "completed":
            raise DisaggError(self.end)
        return self.end

    # the coordinator's side (``Disagg`` drives the flow through these)
    async def deliver(self, event: wire.Event) -> None:
        """Hand a decode event to whoever iterates the flow (waits while its buffer is full)."""
        await self._send.send(event)

    def close_events(self) -> None:
        """No more events: iterating the flow ends once the buffered ones are read."""
        self._send.close()

    def ended(self, outcome: str, error: wire.ErrorBody | None) -> FlowEnd:
        return FlowEnd(
            outcome=outcome,
            error=error,
            mode=self.mode,
            prefill=self.prefill_url,
            decode=self.decode_url,
            room=None if self.room is None else str(self.room),
            attempts=list(self.attempts),
        )

    def exhausted(self, role: Role) -> FlowOver:
        mine = [a for a in self.attempts if a.role == role]
        reasons = "; ".join(f"{a.url}: {a.result} {a.code or ''} {a.message}".strip() for a in mine)
        message = f"no {role} sidecar could take the request ({reasons})"
        others = [a for a in self.attempts if a.role != role and a.result != "completed"]
        if others:  # the other side failed too: say so, or fixing one side meets the other next
            other = others[0].role
            message += f"; {other} side: " + "; ".join(
                f"{a.url}: {a.result} {a.code or ''} {a.message}".strip() for a in others
            )
        last = mine[-1] if mine else None
        retryable = any(a.retryable for a in mine)
        code = (last.code if last is not None else None) or "ERROR_CODE_INTERNAL"
        return FlowOver(self.ended("rejected", error_body(code, message, retryable)))

    def side_over(self, side: Side) -> FlowOver:
        """The flow ends because of ``side`` (its own error; ``failed`` once anything was accepted)."""
        end = side.end
        outcome = end.outcome if end is not None and side.lost is None and side.problem is None else "failed"
        if side.role == "prefill" and outcome == "completed":
            outcome = "failed"
        return FlowOver(self.ended(outcome, side.error()))
