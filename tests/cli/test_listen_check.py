"""``run``'s listen addresses tried together before any is served (``sidecar.listen_check``):
real sockets held by the test, real ZMQ sockets."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import trio
import zmq

from sidecar.core.sidecar import StartupError
from sidecar.kvbridge import KvBridgeConfig
from sidecar.listen_check import Listener, ListenerClash, check_listeners, check_run_listeners

IN_USE = "Address already in use"


@contextmanager
def held() -> Iterator[int]:
    """A port some other process might hold: bound and listening until the block ends."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_every_clash_at_once_each_with_its_flag() -> None:
    with held() as a, held() as b, trio.fail_after(10):
        ok = free_port()
        listeners = [
            Listener("--http-listen", f"127.0.0.1:{a}"),
            Listener("--listen", f"127.0.0.1:{ok}"),
            Listener("--kv-publish", f"tcp://127.0.0.1:{b}", zmq.PUB),
            Listener("--kv-replay", f"tcp://127.0.0.1:{b}", zmq.ROUTER, "DP rank 1"),
        ]
        with pytest.raises(ListenerClash) as caught:
            await check_listeners(listeners)
    failed = caught.value.failures
    assert [f.listener.flag for f in failed] == ["--http-listen", "--kv-publish", "--kv-replay"]
    assert all(f.reason == IN_USE and f.in_use for f in failed)
    assert str(caught.value) == (
        f"cannot listen on --http-listen 127.0.0.1:{a} ({IN_USE}), --kv-publish tcp://127.0.0.1:{b} "
        f"({IN_USE}), --kv-replay tcp://127.0.0.1:{b} (DP rank 1: {IN_USE}) (in use by another process: "
        "a second sidecar on one host needs its own ports, or port 0 for any free one)"
    )


async def test_two_flags_given_one_port_clash_with_each_other() -> None:
    port = free_port()
    with trio.fail_after(10), pytest.raises(ListenerClash) as caught:
        await check_listeners(
            [
                Listener("--http-listen", f"127.0.0.1:{port}"),
                Listener("--kv-publish", f"tcp://*:{port}", zmq.PUB),
            ]
        )
    (failure,) = caught.value.failures
    assert failure.listener.flag == "--kv-publish"
    assert failure.reason == f"{IN_USE}; --http-listen is given that port too" and not failure.in_use
    assert "another process" not in str(caught.value)


async def test_everything_is_released_for_the_servers() -> None:
    """The servers bind right after: the check must hold nothing (ZMQ closes asynchronously)."""
    port, zport = free_port(), free_port()
    listeners = [
        Listener("--listen", f"127.0.0.1:{port}"),
        Listener("--kv-publish", f"tcp://127.0.0.1:{zport}", zmq.PUB),
    ]
    ctx = zmq.Context()
    try:
        for _ in range(20):
            with trio.fail_after(10):
                await check_listeners(listeners)
            server = await trio.open_tcp_listeners(port, host="127.0.0.1")
            pub = ctx.socket(zmq.PUB)
            pub.bind(f"tcp://127.0.0.1:{zport}")
            for listener in server:
                await listener.aclose()
            pub.close(linger=0)
            ctx.destroy(linger=0)  # wait for the close before the next round
            ctx = zmq.Context()
    finally:
        ctx.destroy(linger=0)


async def test_an_address_that_is_not_local_and_endpoints_left_to_their_server() -> None:
    with trio.fail_after(10), pytest.raises(ListenerClash) as caught:
        await check_listeners(
            [
                Listener("--listen", "192.0.2.1:0"),  # TEST-NET-1: no local address
                Listener("--kv-publish", "ipc:///nonexistent-dir/kv", zmq.PUB),  # not checked
            ]
        )
    (failure,) = caught.value.failures
    assert failure.listener.flag == "--listen" and failure.reason == "Cannot assign requested address"
    assert "another process" not in str(caught.value)


async def test_run_listeners_cover_every_dp_rank_of_the_bridge() -> None:
    with held() as base, trio.fail_after(10):
        kv = KvBridgeConfig(publish_endpoint=f"tcp://127.0.0.1:{base - 1}", replay_endpoint=None)
        ok = free_port()
        with pytest.raises(StartupError) as caught:
            await check_run_listeners(f"127.0.0.1:{ok}", "127.0.0.1:0", kv, [0, 1])
        # rank 1 binds port + 1 (rank 0's port, base - 1, is whatever this host has free or not)
        assert f"--kv-publish tcp://127.0.0.1:{base} (DP rank 1: {IN_USE})" in str(caught.value)
        # no bridge (disabled, or an engine without KV event sources): its ports are not looked at
        await check_run_listeners(f"127.0.0.1:{ok}", "127.0.0.1:0", None, [0, 1])
