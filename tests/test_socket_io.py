"""``sidecar.socket_io``'s ``write_now`` and ``receive_some`` on real loopback sockets."""

from __future__ import annotations

import socket
import struct

import pytest
import trio
import trio.testing

from sidecar.socket_io import receive_some, write_now


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


async def _pair() -> tuple[trio.SocketStream, trio.SocketStream, trio.SocketListener]:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    client = await trio.open_tcp_stream("127.0.0.1", port)
    server = await listeners[0].accept()
    return client, server, listeners[0]


async def test_receive_some_reads_waits_and_ends_as_trio_does() -> None:
    """What is there at once; a wait (cancellable) until the peer writes; at most ``max_bytes``;
    ``b""`` once the peer closed; ``ClosedResourceError`` after our own close."""
    client, server, listener = await _pair()
    await server.send_all(b"hello")
    with trio.fail_after(5):
        assert await receive_some(client, 65536) == b"hello"
    with trio.move_on_after(0.05) as waited:  # nothing written: it waits, and is cancellable
        await receive_some(client, 65536)
    assert waited.cancelled_caught
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.send_all, b"abcdef")
        with trio.fail_after(5):
            assert await receive_some(client, 4) == b"abcd"
            assert await receive_some(client, 4) == b"ef"
    await server.aclose()
    with trio.fail_after(5):
        assert await receive_some(client, 65536) == b""
    await client.aclose()
    with pytest.raises(trio.ClosedResourceError):
        await receive_some(client, 65536)
    await listener.aclose()


async def test_receive_some_reset_is_broken_and_other_streams_use_their_own() -> None:
    """A reset connection raises ``BrokenResourceError`` (as trio's); a stream that is not a plain
    socket (TLS, a stapled or memory stream) is read with its own ``receive_some``."""
    client, server, listener = await _pair()
    server.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    await server.aclose()  # RST
    with trio.fail_after(5), pytest.raises(trio.BrokenResourceError):
        await receive_some(client, 65536)
    await client.aclose()
    await listener.aclose()
    send, receive = trio.testing.memory_stream_pair()
    await send.send_all(b"memory")
    with trio.fail_after(5):
        assert await receive_some(receive, 65536) == b"memory"
