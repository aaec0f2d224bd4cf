"""KV event sources: what ``GetKvEventSources`` advertises, validated into one source per DP rank.

Rules (docs/design/engine-facts.md "KV events over gRPC", kv.proto ``KvEventSource``):

- a source's ``transport`` is ``grpc`` (``SubscribeKvEvents`` on the engine we already talk
  to; encoding ``protobuf``) or ``zmq`` (encoding ``msgpack``); an empty encoding means the
  transport's own; other transports are ignored (logged), other encodings make the source
  unusable;
- ``endpoint_addr`` must be routable: a real host (never ``0.0.0.0``, ``*``, ``::``, empty)
  and a port in 1..65535 over ``tcp``; required for ``zmq``, checked when present for
  ``grpc``;
- ``replay_endpoint`` (``zmq``) is a ZMQ endpoint (``tcp://host:port``, a bare ``host:port``
  means tcp); a wildcard host in it — engines often advertise their bind string — is
  replaced by the ``endpoint_addr`` host;
- a source without ``data_parallel_rank`` serves every expected rank (``grpc``) or the only
  expected rank (``zmq``);
- every expected rank is covered by exactly one usable source per transport; the native
  ``grpc`` stream wins over ``zmq`` when both are offered; a rank nobody serves, a rank
  served twice over one transport, or a source for an unexpected rank is a
  :class:`KvSourceError` listing every problem.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from sidecar.kvbridge.errors import KvSourceError
from sidecar.openengine import pb

log = logging.getLogger(__name__)

WILDCARD_HOSTS = frozenset({"", "*", "0.0.0.0", "::", "[::]", "::0", "0:0:0:0:0:0:0:0", "[::0]"})

_ENCODINGS = {"grpc": frozenset({"", "protobuf", "proto"}), "zmq": frozenset({"", "msgpack"})}


@dataclass(frozen=True, slots=True)
class ZmqSource:
    """An engine ZMQ publisher for one DP rank (``endpoint`` and ``replay_endpoint`` connectable)."""

    rank: int
    endpoint: str
    topic: str = ""
    replay_endpoint: str | None = None
    hwm: int | None = None
    transport: Literal["zmq"] = "zmq"


@dataclass(frozen=True, slots=True)
class GrpcSource:
    """``SubscribeKvEvents`` for one DP rank, through the sidecar's ``EngineClient``."""

    rank: int
    transport: Literal["grpc"] = "grpc"


KvSource = ZmqSource | GrpcSource


def _tcp(host: str, port: int) -> str:
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"tcp://{host}:{port}"


_PROTOCOLS = {"zmq": ("", "tcp"), "grpc": ("", "tcp", "grpc", "grpcs", "http", "https", "h2", "h2c")}


def _endpoint(addr: pb.KvEndpoint | None, what: str, transport: str = "zmq") -> tuple[str | None, str | None]:
    """(zmq endpoint, problem)"""
    if addr is None:
        return None, f"{what} has no endpoint_addr"
    protocol = addr.protocol.strip().lower()
    if protocol not in _PROTOCOLS[transport]:
        return (
            None,
            f"{what} endpoint protocol {addr.protocol!r} is not one of {'/'.join(_PROTOCOLS[transport][1:])}",
        )
    host = addr.host.strip()
    if host.lower() in WILDCARD_HOSTS:
        return None, f"{what} endpoint host {addr.host!r} is not routable (a bind wildcard)"
    if not 1 <= addr.port <= 65535:
        return None, f"{what} endpoint port {addr.port} is out of range"
    return _tcp(host, addr.port), None


def _replay(text: str, fallback_host: str, what: str) -> tuple[str | None, str | None]:
    t = text.strip()
    if not t:
        return None, None
    if "://" not in t:
        t = "tcp://" + t
    scheme, rest = t.split("://", 1)
    if scheme == "ipc":
        return (t, None) if rest else (None, f"{what} replay endpoint {text!r} has no path")
    if scheme != "tcp":
        return None, f"{what} replay endpoint {text!r} is not tcp:// or ipc://"
    host, sep, port_s = rest.rpartition(":")
    if not sep or not port_s.isdigit() or not 1 <= int(port_s) <= 65535:
        return None, f"{what} replay endpoint {text!r} has no valid port"
    if host.lower() in WILDCARD_HOSTS:
        host = fallback_host
    host = host.strip("[]")
    return _tcp(host, int(port_s)), None


def plan_sources(resp: pb.GetKvEventSourcesResponse, dp_ranks: Iterable[int] | None = None) -> list[KvSource]:
    """One validated source per DP rank, sorted by rank; raises :class:`KvSourceError`.

    ``dp_ranks`` are the ranks this sidecar must bridge (from ``ServerInfo.parallelism``);
    ``None`` takes the advertised ranks (rank 0 when no source names one).
    """
    expected = sorted(set(dp_ranks)) if dp_ranks is not None else None
    problems: list[str] = []
    unusable: dict[int | None, list[str]] = {}
    usable: dict[str, dict[int, list[KvSource]]] = {"grpc": {}, "zmq": {}}

    advertised = {s.data_parallel_rank for s in resp.sources if s.data_parallel_rank is not None}
    if expected is None:
        expected = sorted(advertised) or [0]
    if not expected:
        raise KvSourceError("no DP ranks to bridge")
    for i, src in enumerate(resp.sources):
        transport = src.transport.strip().lower()
        rank = src.data_parallel_rank
        what = f"source #{i} ({src.transport or 'no transport'}, rank {'any' if rank is None else rank})"
        if transport not in _ENCODINGS:
            log.warning("ignoring KV event %s: unknown transport", what)
            unusable.setdefault(rank, []).append(f"{what}: unknown transport {src.transport!r}")
            continue
        if rank is not None and rank not in expected:
            problems.append(f"{what}: rank {rank} is not one of this worker's ranks {expected}")
            continue
        if src.encoding.strip().lower() not in _ENCODINGS[transport]:
            unusable.setdefault(rank, []).append(
                f"{what}: encoding {src.encoding!r} unsupported for {transport}"
            )
            continue
        if transport == "grpc":
            if src.endpoint_addr is not None and (src.endpoint_addr.host or src.endpoint_addr.port):
                _, problem = _endpoint(src.endpoint_addr, what, "grpc")
                if problem:
                    unusable.setdefault(rank, []).append(problem)
                    continue
            for r in [rank] if rank is not None else expected:
                usable["grpc"].setdefault(r, []).append(GrpcSource(r))
            continue
        endpoint, problem = _endpoint(src.endpoint_addr, what)
        replay, replay_problem = (None, None)
        if endpoint is not None:
            assert src.endpoint_addr is not None
            replay, replay_problem = _replay(src.replay_endpoint, src.endpoint_addr.host.strip(), what)
        problem = problem or replay_problem
        if problem:
            unusable.setdefault(rank, []).append(problem)
            continue
        if rank is None:
            if len(expected) != 1:
                problems.append(f"{what}: a zmq source without data_parallel_rank, but {len(expected)} ranks")
                continue
            rank = expected[0]
        assert endpoint is not None
        usable["zmq"].setdefault(rank, []).append(
            ZmqSource(rank, endpoint, src.topic, replay, src.hwm if src.hwm else None)
        )

    plan: list[KvSource] = []
    for r in expected:
        chosen: KvSource | None = None
        for transport in ("grpc", "zmq"):
            candidates = usable[transport].get(r, [])
            if len(candidates) > 1:
                problems.append(f"rank {r} has {len(candidates)} {transport} sources")
            elif candidates and chosen is None:
                chosen = candidates[0]
        if chosen is None:
            why = unusable.get(r, []) + unusable.get(None, [])
            problems.append(f"rank {r} has no usable source" + (f" ({'; '.join(why)})" if why else ""))
            continue
        plan.append(chosen)
    if problems:
        raise KvSourceError("engine KV event sources are unusable", problems)
    return plan
