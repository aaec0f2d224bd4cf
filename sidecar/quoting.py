"""Untrusted text in log lines and error messages: escaped and cut, in one place.

Whatever a client (or an engine) controls — request ids, model and adapter names, unknown
field or ``type`` values, close reasons — may contain newlines or terminal escapes (a forged
log line) and may be megabytes long (an error message or log line as large as the frame).
:func:`quote` is the one way such a value goes into a log line or a message sent back.
"""

from __future__ import annotations

__all__ = ["QUOTE_LIMIT", "clip", "quote"]

#: Characters of an untrusted value kept in a log line or an error message.
QUOTE_LIMIT = 80


def quote(value: object, limit: int = QUOTE_LIMIT) -> str:
    """``value`` as a quoted Python literal: control and other non-printable characters
    escaped (``\\n``, ``\\x1b``), at most ``limit`` characters of it kept (the rest counted:
    ``'abc'…(+1234)``). Costs O(``limit``) whatever the value's size."""
    text = value if isinstance(value, str) else str(value)
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}…(+{len(text) - limit})"


def clip(text: str, limit: int) -> str:
    """``text`` (already built from quoted parts, e.g. a library's error message) with its
    control characters escaped, cut to ``limit`` characters (the rest counted: ``…(+N)``)."""
    head = text[:limit]
    if not head.isprintable():
        head = "".join(c if c.isprintable() else repr(c)[1:-1] for c in head)[:limit]
    cut = len(text) - limit
    return f"{head}…(+{cut})" if cut > 0 else head
