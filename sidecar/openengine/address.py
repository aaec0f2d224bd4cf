"""Engine address forms: ``host:port``, ``http://host:port``, ``unix:///path``."""

from __future__ import annotations

from urllib.parse import urlsplit

from sidecar.addresses import SocketAddress
from sidecar.openengine.engine_errors import EngineConfigError

#: Where the engine's gRPC server listens: TCP ``host``/``port`` or a Unix socket ``path``.
EngineAddress = SocketAddress


def parse_engine_address(text: str) -> EngineAddress:
    """Parse an engine address; raise :class:`EngineConfigError` with the accepted forms otherwise."""
    raw = text.strip()
    forms = "expected host:port, http://host:port or unix:///absolute/path"
    if raw.startswith("unix://"):
        path = raw[len("unix://") :]
        if not path.startswith("/"):
            raise EngineConfigError(f"engine address {text!r}: unix socket path must be absolute ({forms})")
        return EngineAddress(path=path)
    if raw.startswith("unix:"):
        path = raw[len("unix:") :]
        if path.startswith("/"):
            return EngineAddress(path=path)
        raise EngineConfigError(f"engine address {text!r}: {forms}")
    if "://" in raw:
        parts = urlsplit(raw)
        if parts.scheme != "http" or parts.path not in ("", "/") or parts.query or parts.fragment:
            raise EngineConfigError(f"engine address {text!r}: {forms}")
        netloc = parts.netloc
    else:
        netloc = raw
    try:
        parts = urlsplit(f"//{netloc}")
        host, port = parts.hostname, parts.port
    except ValueError as err:
        raise EngineConfigError(f"engine address {text!r}: {err} ({forms})") from None
    if not host or port is None or port == 0 or parts.username or parts.password:
        raise EngineConfigError(f"engine address {text!r}: {forms}")
    return EngineAddress(host=host, port=port)
