"""Typed errors of the core: a request :class:`Rejection` and the discovery failures.

A :class:`Rejection` is raised before anything reaches the engine; it carries the
OpenEngine ``ErrorCode`` the north protocol reports in ``end rejected``. Discovery
failures (:class:`DiscoveryError`, :class:`NegotiationError`) are fatal for serving
and carry a one-line, operator-readable reason as ``str(err)``.
"""

from __future__ import annotations

from typing import NoReturn

from sidecar.openengine import pb
from sidecar.quoting import clip

#: Longest rejection message (client values quoted in one are cut shorter: sidecar.quoting).
MAX_MESSAGE = 1024

__all__ = [
    "DiscoveryError",
    "NegotiationError",
    "Rejection",
    "error_code_name",
    "invalid_argument",
    "model_not_found",
    "role_mismatch",
    "unsupported",
]


def error_code_name(code: pb.ErrorCode) -> str:
    """Proto name of a code (``ERROR_CODE_INVALID_ARGUMENT``), as the north protocol spells it."""
    member = pb.ErrorCode._value2member_map_.get(int(code))
    name = getattr(member, "proto_name", None) if member is not None else None
    return name if isinstance(name, str) and name else "ERROR_CODE_UNSPECIFIED"


class Rejection(Exception):
    """A request refused before acceptance: nothing was sent to the engine.

    ``code`` is the OpenEngine ``ErrorCode``; ``message`` a one-line reason;
    ``retryable`` whether the unchanged request can succeed on retry (here or on
    another worker of the same kind).
    """

    def __init__(self, code: pb.ErrorCode, message: str, retryable: bool = False) -> None:
        message = clip(message, MAX_MESSAGE)
        super().__init__(message)
        self.code = code
        self.message = message
        self.retryable = retryable

    def __repr__(self) -> str:
        return f"Rejection({error_code_name(self.code)}, {self.message!r}, retryable={self.retryable})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Rejection):
            return NotImplemented
        return (self.code, self.message, self.retryable) == (other.code, other.message, other.retryable)

    __hash__ = Exception.__hash__

    @property
    def code_name(self) -> str:
        """``ERROR_CODE_…`` name of :attr:`code`."""
        return error_code_name(self.code)

    def to_engine_error(self) -> pb.EngineError:
        """The same rejection as an OpenEngine ``EngineError`` message."""
        return pb.EngineError(code=self.code, message=self.message, retryable=self.retryable)

    def to_dict(self) -> dict[str, str | bool]:
        """North-protocol error object ``{"code": "ERROR_CODE_…", "message": …, "retryable": …}``."""
        return {"code": self.code_name, "message": self.message, "retryable": self.retryable}


def invalid_argument(message: str) -> NoReturn:
    """Raise a malformed-value :class:`Rejection` (``ERROR_CODE_INVALID_ARGUMENT``)."""
    raise Rejection(pb.ErrorCode.INVALID_ARGUMENT, message)


def unsupported(message: str) -> NoReturn:
    """Raise ``ERROR_CODE_UNSUPPORTED_FEATURE``: the worker card does not advertise it."""
    raise Rejection(pb.ErrorCode.UNSUPPORTED_FEATURE, message)


def role_mismatch(message: str) -> NoReturn:
    """Raise ``ERROR_CODE_ROLE_MISMATCH``: the request is shaped for another engine role."""
    raise Rejection(pb.ErrorCode.ROLE_MISMATCH, message)


def model_not_found(message: str) -> NoReturn:
    """Raise ``ERROR_CODE_MODEL_NOT_FOUND``: no served model, alias or loaded adapter by that name."""
    raise Rejection(pb.ErrorCode.MODEL_NOT_FOUND, message)


class DiscoveryError(Exception):
    """The engine cannot be served as discovered (fatal; ``str(err)`` is one line)."""


class NegotiationError(DiscoveryError):
    """The engine's schema revision or release is outside what this build accepts (fail closed)."""
