"""Log output of every subcommand: ``--log-level`` and ``--log-format`` (``text`` or ``json``).

``text`` (the default): one line per record on stderr — time, level, logger, message.
``json``: one JSON object per line on stderr, for journald, Loki and Kubernetes log
collectors, written by python-json-logger (the stdlib ``json`` encoder escapes whatever a
message holds, so a client-supplied string can never forge a second record)::

    {"timestamp": "2026-01-01T12:00:00.123456+00:00", "level": "INFO",
     "logger": "sidecar.run", "message": "...", "request_id": "sc-...", "stream": 3}

``request_id`` and ``stream`` are present on records logged while a stream is being served:
:func:`log_context` sets them for the task (and its children) that run one stream, a
logging filter copies them onto each record. Any ``extra={...}`` fields of a call appear as
fields too. ``text`` leaves them out (the messages that matter already name the request).
"""

from __future__ import annotations

import contextvars
import logging
import sys
from typing import Any

LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("text", "json")

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

#: Fields of the stream being served by the current task (``request_id``, ``stream``).
_CONTEXT: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "openengine_sidecar_log_context", default=None
)


class log_context:  # lower case: used as a function, ``with log_context(...)``
    """Add ``fields`` to every record logged by this task (and tasks it starts) inside the block.

    A class rather than a ``contextmanager`` generator: it is entered twice per stream."""

    __slots__ = ("_fields", "_token")

    def __init__(self, **fields: Any) -> None:
        self._fields = fields
        self._token: contextvars.Token[dict[str, Any] | None] | None = None

    def __enter__(self) -> None:
        current = _CONTEXT.get()
        self._token = _CONTEXT.set({**current, **self._fields} if current else self._fields)

    def __exit__(self, *exc_info: object) -> None:
        if self._token is not None:
            _CONTEXT.reset(self._token)


class _ContextFilter(logging.Filter):
    """Copies the :func:`log_context` fields onto each record (never overwriting its own)."""

    def filter(self, record: logging.LogRecord) -> bool:
        fields = _CONTEXT.get()
        if fields:
            for key, value in fields.items():
                if not hasattr(record, key):
                    setattr(record, key, value)
        return True


def json_formatter() -> logging.Formatter:
    """One JSON object per record: ``timestamp`` (ISO 8601, UTC), ``level``, ``logger``,
    ``message``, then any context or ``extra`` fields; ``exc_info`` when there is one."""
    from pythonjsonlogger.json import JsonFormatter

    return JsonFormatter(
        "%(levelname)s %(name)s %(message)s",
        rename_fields={"levelname": "level", "name": "logger"},
        timestamp=True,
    )


def setup_logging(level: str = "info", fmt: str = "text") -> None:
    """Configure the root logger: ``level`` (one of :data:`LEVELS`), ``fmt`` (:data:`FORMATS`).

    Idempotent: a second call replaces the first one's handler (the CLI calls it as soon as
    it knows the level and format, before and after the subcommand's options are read).
    """
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, "_openengine_sidecar", False):
            root.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler._openengine_sidecar = True  # type: ignore[attr-defined]
    handler.setFormatter(json_formatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    handler.addFilter(_ContextFilter())
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
    # The HTTP/2 libraries' wire-level loggers log every header value at DEBUG (routing keys,
    # application metadata): never let --log-level debug put request metadata in the logs.
    for name in ("hpack", "h2"):
        logging.getLogger(name).setLevel(max(logging.INFO, root.level))
