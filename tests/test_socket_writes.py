"""``sidecar.socket_writes.write_now`` on real loopback sockets."""

from __future__ import annotations

import trio

from sidecar.socket_writes import write_now


async def test_write_now_takes_what_the_kernel_takes_and_nothing_on_tls() -> None:
    """``write_now``: all of a small write on a plain TCP stream or socket, part of one larger
    than the socket buffers (the rest is the caller's), none on a stream that is not a plain
    socket (TLS) or a closed one."""

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    async with trio.open_nursery() as nursery:
        peer: list[trio.SocketStream] = []

        async def accept() -> None:
            peer.append(await listeners[0].accept())

        nursery.start_soon(accept)
        client = await trio.open_tcp_stream("127.0.0.1", port)
    assert write_now(client, b"hello") == 5
    assert write_now(client.socket, b"hello") == 5
    assert 0 < write_now(client, b"x" * (64 * 1024 * 1024)) < 64 * 1024 * 1024
    assert write_now(trio.StapledStream(client, client), b"hello") == 0
    await client.aclose()
    assert write_now(client, b"hello") == 0
    await peer[0].aclose()
    await listeners[0].aclose()
