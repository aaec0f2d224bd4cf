"""Every private name of grpclib (and of the h2 connection it holds) the sidecar uses: here only.

grpclib serves the simulated engines and the engine adapters (asyncio programs); it has no
public API for two things they need, so this module reaches into grpclib 0.4.9 and h2 4.x
(pinned ``grpclib>=0.4.9,<0.5``) and nothing else in the repository does.
:func:`missing_internals` lists what a release lacks;
``tests/openengine/test_grpclib_internals.py`` asserts it is empty and exercises every function
against a real server, so an upgrade that renames or reshapes one fails there, loudly.

- ``Server._server`` (the asyncio server): the port an ephemeral TCP listen got.
- ``grpclib.protocol.H2Connection`` (replaced; benchmark engine processes only): server
  connections advertising a different ``SETTINGS_MAX_CONCURRENT_STREAMS``.
"""

from __future__ import annotations

import inspect
from typing import Any

import grpclib.protocol
import grpclib.server
from h2.connection import H2Connection
from h2.settings import SettingCodes, Settings

__all__ = ["advertise_max_concurrent_streams", "missing_internals", "server_port"]


def server_port(server: grpclib.server.Server) -> int | None:
    """The TCP port a started server listens on (None for a unix socket or not started)."""
    listener: Any = server._server
    for sock in listener.sockets if listener is not None else ():
        address = sock.getsockname()
        if isinstance(address, tuple):
            return int(address[1])
    return None


def advertise_max_concurrent_streams(limit: int) -> None:
    """Make every HTTP/2 server connection grpclib opens from now on in this process advertise
    ``limit`` concurrent streams (grpclib's servers advertise h2's default, 100). For the
    benchmark's engine processes only: it replaces grpclib's ``H2Connection`` for good."""

    class _WideH2Connection(H2Connection):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            if not self.config.client_side:
                self.local_settings = Settings(
                    client=False,
                    initial_values={
                        SettingCodes.MAX_CONCURRENT_STREAMS: limit,
                        SettingCodes.MAX_HEADER_LIST_SIZE: self.DEFAULT_MAX_HEADER_LIST_SIZE,
                    },
                )

    grpclib.protocol.H2Connection = _WideH2Connection  # type: ignore[misc]


def missing_internals() -> list[str]:
    """The names above that this grpclib / h2 lacks (empty when all are there; read from the
    classes: no server or event loop is created)."""
    wanted: list[tuple[Any, str]] = [
        (grpclib.protocol, "H2Connection"),
        (H2Connection, "DEFAULT_MAX_HEADER_LIST_SIZE"),
    ]
    missing = [f"{owner.__name__}.{name}" for owner, name in wanted if not hasattr(owner, name)]
    if "self._server" not in inspect.getsource(grpclib.server.Server):
        missing.append("Server._server")
    return missing
