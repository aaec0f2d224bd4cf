"""Clients of the north protocol: the Python client library and the CLI commands built on it."""

from sidecar.client.sidecar_client import (
    DEFAULT_PATH,
    SidecarCallError,
    SidecarClient,
    SidecarConnectionError,
    SidecarError,
    SidecarStream,
    SidecarStreamError,
    open_sidecar,
    sidecar_url,
)

__all__ = [
    "DEFAULT_PATH",
    "SidecarCallError",
    "SidecarClient",
    "SidecarConnectionError",
    "SidecarError",
    "SidecarStream",
    "SidecarStreamError",
    "open_sidecar",
    "sidecar_url",
]
