"""Typed errors of the OpenEngine layer.

Every failure of a call through :class:`~sidecar.openengine.client.EngineClient` is one of
these; grpclib, h2 and asyncio exceptions never leak past this layer. Each carries the
OpenEngine ``ErrorCode`` that best describes it (or ``None``) and whether retrying the
unchanged operation may succeed.
"""

from __future__ import annotations

from sidecar.openengine import pb


def wire_name(value: pb.ErrorCode) -> str:
    """Proto enum name of an ErrorCode; unknown numbers read as ``ERROR_CODE_UNSPECIFIED`` (schema rule)."""
    return (value.proto_name if value.name else None) or "ERROR_CODE_UNSPECIFIED"


class EngineClientError(Exception):
    """Base of every OpenEngine-layer error."""

    code: pb.ErrorCode | None = None
    retryable: bool = False

    def code_name(self) -> str:
        """The OpenEngine code as its wire name (``ERROR_CODE_INTERNAL`` when none applies)."""
        return wire_name(self.code if self.code is not None else pb.ErrorCode.INTERNAL)


class EngineConfigError(EngineClientError):
    """The client was configured wrongly (e.g. an engine address it cannot parse)."""


class EngineUnavailable(EngineClientError):
    """The engine could not be reached, or the connection failed mid-call (retryable)."""

    code = pb.ErrorCode.INTERNAL
    retryable = True


class EngineStatusError(EngineClientError):
    """The engine answered with a non-OK gRPC status (before acceptance, or a unary failure).

    ``status`` is the gRPC status name (``"INVALID_ARGUMENT"``), ``status_code`` its number.
    """

    def __init__(self, status: str, status_code: int, message: str, code: pb.ErrorCode | None) -> None:
        super().__init__(f"engine answered {status}: {message}" if message else f"engine answered {status}")
        self.status = status
        self.status_code = status_code
        self.message = message
        self.code = code
        self.retryable = status in _RETRYABLE_STATUSES


class EngineTerminalError(EngineClientError):
    """An accepted stream failed: the engine sent its one terminal ``EngineError``.

    ``event`` is the whole response that carried it (a ``GenerateResponse``,
    ``DrainResponse`` or ``SubscribeKvEventsResponse``), so callers can relay it.
    """

    def __init__(self, error: pb.EngineError, event: object) -> None:
        super().__init__(f"{wire_name(error.code)}: {error.message}")
        self.code = error.code
        self.message = error.message
        self.retryable = error.retryable
        self.event = event


class EngineProtocolError(EngineClientError):
    """The engine broke an OpenEngine stream rule (the stream can no longer be trusted)."""

    code = pb.ErrorCode.INTERNAL
    retryable = True


class EngineMessageTooLarge(EngineProtocolError):
    """The engine announced a message larger than the caller's bound; nothing of it was read.

    The stream is unusable afterwards (the caller leaves it, which resets it). ``size`` is
    the announced length, ``limit`` the bound.
    """

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"engine message of {size} bytes exceeds the limit of {limit} bytes")
        self.size = size
        self.limit = limit


#: gRPC statuses after which the same request may succeed later.
_RETRYABLE_STATUSES = frozenset({"UNAVAILABLE", "RESOURCE_EXHAUSTED", "ABORTED"})

#: gRPC status -> the OpenEngine code a client reports for it (None: depends on the call).
STATUS_TO_CODE: dict[str, pb.ErrorCode | None] = {
    "INVALID_ARGUMENT": pb.ErrorCode.INVALID_ARGUMENT,
    "OUT_OF_RANGE": pb.ErrorCode.INVALID_ARGUMENT,
    "UNIMPLEMENTED": pb.ErrorCode.UNSUPPORTED_FEATURE,
    "RESOURCE_EXHAUSTED": pb.ErrorCode.OVERLOADED,
    "ALREADY_EXISTS": pb.ErrorCode.DUPLICATE_REQUEST,
    "CANCELLED": pb.ErrorCode.CANCELLED,
    "UNAVAILABLE": pb.ErrorCode.INTERNAL,
    "INTERNAL": pb.ErrorCode.INTERNAL,
    "UNKNOWN": pb.ErrorCode.INTERNAL,
    "DATA_LOSS": pb.ErrorCode.INTERNAL,
    "NOT_FOUND": None,
    "FAILED_PRECONDITION": None,
    "PERMISSION_DENIED": None,
    "UNAUTHENTICATED": None,
    "DEADLINE_EXCEEDED": None,
    "ABORTED": None,
}
