"""Addresses an adapter advertises: the KV publisher's routable host and ports, its event sources.

I/O-free except :func:`free_port` (binds a socket to find a port).
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass

from sidecar.openengine import pb


def advertised_host(listen: str, kv_host: str = "") -> str:
    """The routable host of a KV publisher: ``kv_host``, else the listen host when it is one
    (not a wildcard, not a Unix socket), else ``127.0.0.1``."""
    if kv_host:
        return kv_host
    host = listen.rpartition(":")[0].strip("[]") if not listen.startswith("unix:") else ""
    try:
        if host and not ipaddress.ip_address(host).is_unspecified:
            return host
    except ValueError:
        return host or "127.0.0.1"
    return "127.0.0.1"


def free_port(host: str) -> int:
    """A TCP port free on ``host`` right now (the publisher binds it a moment later)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class KvEndpoints:
    """The engine's publisher binds wildcard ports (vLLM and SGLang connect to any other tcp
    address); ``host`` is what is advertised."""

    host: str
    port: int
    replay_port: int

    @property
    def bind(self) -> str:
        return f"tcp://*:{self.port}"

    @property
    def replay_bind(self) -> str:
        return f"tcp://*:{self.replay_port}"


def kv_endpoints(listen: str, kv_host: str, port: int, replay_port: int) -> KvEndpoints:
    """The publisher's endpoints; a port 0 is replaced by a free one."""
    host = advertised_host(listen, kv_host)
    return KvEndpoints(host, port or free_port(host), replay_port or free_port(host))


def zmq_kv_sources(kv: KvEndpoints | None, topic: str, buffer_steps: int) -> pb.GetKvEventSourcesResponse:
    """The engine's own ZMQ publisher (rank 0), at the routable address, with its replay socket."""
    if kv is None:
        return pb.GetKvEventSourcesResponse()
    source = pb.KvEventSource(
        transport="zmq",
        endpoint_addr=pb.KvEndpoint(host=kv.host, port=kv.port, protocol="tcp"),
        topic=topic,
        replay_endpoint=f"tcp://{kv.host}:{kv.replay_port}",
        data_parallel_rank=0,
        encoding="msgpack",
        buffer_steps=buffer_steps,
    )
    return pb.GetKvEventSourcesResponse(sources=[source])
