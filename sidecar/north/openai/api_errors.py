"""Errors the OpenAI way: ``{"error": {"message", "type", "param", "code"}}`` with its status.

How a refusal or a failed stream is answered (:func:`from_outcome`):

===============================================  ======  =======================  ============
OpenEngine code (a rejection or an engine error)  status  ``type``                 Retry-After
===============================================  ======  =======================  ============
``INVALID_ARGUMENT``, ``UNSUPPORTED_FEATURE``,    400     ``invalid_request_error``
``ROLE_MISMATCH``
``MODEL_NOT_FOUND``                               404     ``invalid_request_error``
``DUPLICATE_REQUEST``                             409     ``invalid_request_error``
``OVERLOADED``                                    429     ``rate_limit_error``     1 s
``DRAINING``; any retryable failure (engine       503     ``service_unavailable``  1 s
unreachable or not ready, a stream cancelled by
the drain deadline or shutdown)
anything else                                     500     ``server_error``
===============================================  ======  =======================  ============

``code`` is the OpenEngine code's short name (``model_not_found``, ``draining``, …). A body that
is not a valid request is 400 with ``param`` naming the field; an unknown path 404; a missing or
wrong bearer token 401. Once a stream has sent its first event the status is sent already: a
failure then is an SSE ``data: {"error": …}`` event before ``data: [DONE]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from sidecar.core.errors import error_code_name
from sidecar.core.lifecycle import Outcome
from sidecar.openengine import pb

__all__ = ["ApiError", "from_outcome"]

#: Seconds a client is told to wait before retrying an overloaded or draining sidecar.
RETRY_AFTER = 1

_STATUS = {
    pb.ErrorCode.INVALID_ARGUMENT: 400,
    pb.ErrorCode.UNSUPPORTED_FEATURE: 400,
    pb.ErrorCode.ROLE_MISMATCH: 400,
    pb.ErrorCode.MODEL_NOT_FOUND: 404,
    pb.ErrorCode.DUPLICATE_REQUEST: 409,
    pb.ErrorCode.OVERLOADED: 429,
    pb.ErrorCode.DRAINING: 503,
}
_TYPE = {400: "invalid_request_error", 404: "invalid_request_error", 409: "invalid_request_error"}
_TYPE.update({401: "authentication_error", 413: "invalid_request_error", 408: "invalid_request_error"})
_TYPE.update({429: "rate_limit_error", 503: "service_unavailable", 500: "server_error"})


@dataclass
class ApiError(Exception):
    """An error answer: its status, message and OpenAI fields."""

    status: int
    message: str
    param: str | None = None
    code: str | None = None

    @property
    def type(self) -> str:
        return _TYPE.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")

    @property
    def retry_after(self) -> int | None:
        return RETRY_AFTER if self.status in (429, 503) else None

    def body(self) -> dict[str, dict[str, str | None]]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def encode(self) -> bytes:
        return msgspec.json.encode(self.body())

    def headers(self) -> list[tuple[bytes, bytes]]:
        out = [(b"content-type", b"application/json")]
        if self.retry_after is not None:
            out.append((b"retry-after", str(self.retry_after).encode()))
        return out


def from_outcome(outcome: Outcome) -> ApiError:
    """The answer to a request refused or failed with ``outcome`` (module doc)."""
    code = outcome.code if outcome.code is not None else pb.ErrorCode.INTERNAL
    status = _STATUS.get(code)
    if status is None:
        status = 503 if outcome.retryable else 500
    name = error_code_name(code).removeprefix("ERROR_CODE_").lower()
    return ApiError(status, outcome.message or name, None, name)
