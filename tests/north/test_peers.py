"""Connection limits of the WebSocket listener (``sidecar.north.peers``): peers by address
(IPv6 by /64), counts in total and per peer, streams per peer, the file-descriptor fit."""

from __future__ import annotations

import resource

import pytest

from sidecar.north import peers
from sidecar.north.peers import PeerLimits, fit_to_fd_limit, peer_key


def test_peer_keys() -> None:
    assert peer_key(("10.1.2.3", 5555)) == "10.1.2.3"
    assert peer_key(("2001:db8::1", 5555, 0, 0)) == peer_key(("2001:db8::ffff:1", 1, 0, 0)) == "2001:db8::/64"
    assert peer_key(("2001:db8:0:1::1", 5555, 0, 0)) != peer_key(("2001:db8::1", 5555, 0, 0))
    assert peer_key(("::ffff:10.1.2.3", 5555, 0, 0)) == "10.1.2.3"  # IPv4 on a dual-stack socket
    assert peer_key(("fe80::1%eth0", 1, 0, 2)) == "fe80::/64"
    assert peer_key(None) == peer_key("unix") == "?"


def test_connections_in_total_and_per_peer() -> None:
    limits = PeerLimits(max_connections=3, max_connections_per_peer=2)
    assert limits.connect("a") is None and limits.connect("a") is None
    assert limits.connect("a") == "connections_per_peer"
    assert limits.connect("b") is None
    assert limits.connect("c") == "connections"
    assert limits.connections == 3
    limits.disconnect("a")
    assert limits.connect("c") is None
    for peer in ("a", "b", "c"):
        limits.disconnect(peer)
    assert limits.connections == 0 and not limits._per_peer
    http = PeerLimits(max_connections=2, max_connections_per_peer=1, prefix="http_")
    assert http.connect("a") is None and http.connect("a") == "http_connections_per_peer"
    assert http.connect("b") is None and http.connect("c") == "http_connections"


def test_streams_per_peer() -> None:
    limits = PeerLimits(max_streams_per_peer=2)
    assert limits.open_stream("a") and limits.open_stream("a") and not limits.open_stream("a")
    assert limits.open_stream("b")
    limits.close_stream("a")
    assert limits.open_stream("a")
    assert PeerLimits().open_stream("a")  # 0: no limit


def test_max_connections_fits_the_fd_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    state = {"soft": 1024, "hard": 2048}
    monkeypatch.setattr(resource, "getrlimit", lambda _: (state["soft"], state["hard"]))

    def setrlimit(_: int, limits: tuple[int, int]) -> None:
        state["soft"], state["hard"] = limits

    monkeypatch.setattr(resource, "setrlimit", setrlimit)
    # the soft limit is raised as far as the hard one allows, then the connections are fitted
    assert fit_to_fd_limit(4096) == 2048 - peers.FD_RESERVE and state["soft"] == 2048
    # enough room: raised to what is needed, nothing lowered
    state.update(soft=1024, hard=resource.RLIM_INFINITY)
    assert fit_to_fd_limit(4096) == 4096 and state["soft"] == 4096 + peers.FD_RESERVE
    assert fit_to_fd_limit(0) == 0
