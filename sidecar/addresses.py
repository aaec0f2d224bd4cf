"""Listen addresses: the one parser of ``HOST:PORT`` / ``[V6]:PORT`` / ``:PORT`` /
``unix:///ABSOLUTE/PATH`` for every listener (the sidecar's, the simulated and vLLM engines'),
used by the CLI types at parse time and by the servers when they bind.

Engine addresses (what a client dials: also ``http://host:port``) are
``sidecar.openengine.address``'s.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ListenAddress", "SocketAddress", "join_host_port", "parse_listen", "split_host_port"]


@dataclass(frozen=True)
class SocketAddress:
    """A TCP ``host``/``port`` or a Unix socket ``path`` (where a server listens: port 0 is any
    free port; where a client dials: ``sidecar.openengine.address.EngineAddress``)."""

    host: str | None = None
    port: int | None = None
    path: str | None = None

    def __str__(self) -> str:
        if self.path is not None:
            return f"unix://{self.path}"
        return join_host_port(self.host or "127.0.0.1", self.port or 0)


#: Where a server listens (port 0: any free port).
ListenAddress = SocketAddress


def parse_listen(text: str) -> ListenAddress:
    """``HOST:PORT``, ``[V6]:PORT``, ``:PORT`` or ``unix:///ABSOLUTE/PATH``; ``ValueError``
    naming what is wrong."""
    if text.startswith("unix://"):
        path = text[len("unix://") :]
        if not path.startswith("/"):
            raise ValueError(f"{text!r}: expected unix:///ABSOLUTE/PATH")
        return ListenAddress(path=path)
    if text.startswith("unix:"):
        raise ValueError(f"{text!r}: expected unix:///ABSOLUTE/PATH")
    host, port = split_host_port(text)
    return ListenAddress(host=host, port=port)


def split_host_port(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (IPv6 in brackets) -> (host, port); ``ValueError`` naming what is wrong.
    Port 0 asks the system for any free port; a host left out is loopback, never all interfaces."""
    host, sep, port = text.rpartition(":")
    if not sep:
        raise ValueError(f"{text!r}: expected HOST:PORT (IPv6 as [ADDR]:PORT)")
    if not host:
        return "127.0.0.1", _port(text, port)
    return _host(text, host), _port(text, port)


def _port(text: str, port: str) -> int:
    if not port.isdigit():
        raise ValueError(f"{text!r}: the port must be a number")
    number = int(port)
    if number > 65535:
        raise ValueError(f"{text!r}: port {number} is not in 1-65535 (0: any free port)")
    return number


def _host(text: str, host: str) -> str:
    if host.startswith("["):
        if not host.endswith("]") or len(host) < 3:
            raise ValueError(f"{text!r}: expected [IPv6]:PORT")
        return host[1:-1]
    if ":" in host:
        raise ValueError(f"{text!r}: write an IPv6 address in brackets, [ADDR]:PORT")
    return host


def join_host_port(host: str, port: int) -> str:
    """``host:port``, an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
