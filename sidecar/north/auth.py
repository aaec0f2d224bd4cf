"""Bearer-token check shared by the WebSocket and HTTP listeners."""

from __future__ import annotations

import hmac


def bearer_matches(header: bytes | str | None, token: str) -> bool:
    """Whether an ``Authorization`` header value carries ``Bearer <token>``.

    The scheme is compared case-insensitively (RFC 9110 §11.1: ``bearer`` and ``BEARER``
    are the same scheme); the token exactly and in constant time. Whitespace around the
    value and between scheme and token is ignored; anything else (no header, another
    scheme, a wrong token) is ``False``.
    """
    if header is None:
        return False
    raw = header.encode("latin-1", "replace") if isinstance(header, str) else header
    scheme, _, credentials = raw.strip().partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(credentials.strip(b" "), token.encode())
