"""Typed errors of the KV event bridge."""

from __future__ import annotations

from typing import ClassVar

from sidecar.openengine.stream_rules import Violation


class KvBridgeError(Exception):
    """Base of every KV-bridge error."""


class KvConfigError(KvBridgeError):
    """The bridge was configured wrongly (bad endpoint, buffer size, topic ...)."""


class KvSourceError(KvConfigError):
    """The engine's advertised KV event sources cannot be used.

    ``problems`` lists one line per rejected source or uncovered rank.
    """

    def __init__(self, message: str, problems: list[str] | None = None) -> None:
        self.problems = list(problems or [])
        detail = "; ".join(self.problems)
        super().__init__(f"{message}: {detail}" if detail else message)


class KvDecodeError(KvBridgeError):
    """One upstream batch (msgpack payload or protobuf batch) does not decode.

    The bridge never drops such a batch silently: it counts it and resynchronizes the rank
    (``AllBlocksCleared``) before continuing.
    """

    violation: ClassVar[Violation] = Violation.KV_UNDECODABLE
