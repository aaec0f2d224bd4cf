"""sidecar.client against a fake sidecar: streams, cancel, calls, connection loss."""

from __future__ import annotations

from typing import Any

import pytest
import trio
from trio_websocket import WebSocketRequest, serve_websocket

from sidecar.client import (
    SidecarCallError,
    SidecarConnectionError,
    SidecarStreamError,
    open_sidecar,
    sidecar_url,
)
from sidecar.north import wire
from sidecar.north.codec import CallCommand, Encoding, GenerateCommand
from sidecar.north.http import build_app
from sidecar.north.http_server import serve_http
from sidecar.openengine import pb
from tests.client.fake_sidecar import SESSION_BYTES, FakeSidecar

ENCODINGS = pytest.mark.parametrize("encoding", ["json", "msgpack"])


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("ws://h:1", "ws://h:1/v1/ws"),
        ("ws://h:1/", "ws://h:1/v1/ws"),
        ("wss://h:1", "wss://h:1/v1/ws"),
        ("ws://h:1/custom/path", "ws://h:1/custom/path"),
        ("h:8600", "ws://h:8600/v1/ws"),
        ("ws://[::1]:9", "ws://[::1]:9/v1/ws"),
        ("ws://h:1?x=1", "ws://h:1/v1/ws?x=1"),
    ],
)
def test_sidecar_url(given: str, expected: str) -> None:
    assert sidecar_url(given) == expected


@pytest.mark.parametrize("bad", ["http://h:1", "ws://:1"])
def test_sidecar_url_rejects(bad: str) -> None:
    with pytest.raises(ValueError):
        sidecar_url(bad)


@ENCODINGS
async def test_generate_events_and_end(fake: FakeSidecar, encoding: str) -> None:
    with trio.fail_after(10):
        async with open_sidecar(fake.url, encoding=encoding) as sc:
            request = {"prompt": "hello", "stopping": {"maxTokens": 3}}
            async with sc.generate(request, metadata={"openengine-routing-key": "k"}) as stream:
                events = [event async for event in stream]
            assert "".join(e.response.text for e in events) == "Hello!"
            assert [e.response.kind for e in events] == ["token", "token", "token", "finished"]
            assert all(e.stream == stream.id for e in events)
            assert events[0].response.request_id == "r-1"
            last = events[-1].response
            assert last.finished is not None and last.finished.reason == "FINISH_REASON_LENGTH"
            assert last.usage == wire.Usage(prompt_tokens=1, completion_tokens=3, total_tokens=4)
            assert stream.end == wire.End(stream=stream.id, outcome="completed", error=None)
            assert stream.check() is stream.end
    assert fake.paths == ["/v1/ws"]
    (cmd,) = fake.commands
    assert isinstance(cmd, GenerateCommand)
    assert cmd.encoding is Encoding(encoding)
    assert cmd.request.stopping is not None and cmd.request.stopping.max_tokens == 3
    assert cmd.metadata == {"openengine-routing-key": "k"}
    assert fake.cancels == []


async def test_generate_with_pb_request_and_two_concurrent_streams(fake: FakeSidecar) -> None:
    with trio.fail_after(10):
        async with open_sidecar(fake.url) as sc:
            texts: dict[str, str] = {}

            async def one(name: str, prompt: str) -> None:
                request = pb.GenerateRequest(
                    model="m", prompt=prompt, sampling=pb.SamplingParams(seed=2**64 - 1)
                )
                async with sc.generate(request) as stream:
                    texts[name] = "".join([e.response.text async for e in stream])
                assert stream.end is not None and stream.end.outcome == "completed"

            async with trio.open_nursery() as nursery:
                nursery.start_soon(one, "a", "hello")
                nursery.start_soon(one, "b", "hello")
    assert texts == {"a": "Hello!", "b": "Hello!"}
    sent = [c for c in fake.commands if isinstance(c, GenerateCommand)]
    assert len(sent) == 2 and len({c.stream for c in sent}) == 2
    assert all(c.request.sampling is not None and c.request.sampling.seed == 2**64 - 1 for c in sent)


@ENCODINGS
async def test_cancel_then_end_cancelled(fake: FakeSidecar, encoding: str) -> None:
    with trio.fail_after(10):
        async with open_sidecar(fake.url, encoding=encoding) as sc, sc.generate({"prompt": "slow"}) as stream:
            seen = []
            async for event in stream:
                seen.append(event)
                await stream.cancel()
                await stream.cancel()  # idempotent
            assert len(seen) == 1
            assert stream.end is not None and stream.end.outcome == "cancelled"
            assert stream.end.error == wire.ErrorBody(
                code="ERROR_CODE_CANCELLED", message="cancelled by client", retryable=False
            )
            with pytest.raises(SidecarStreamError) as info:
                stream.check()
            assert info.value.outcome == "cancelled" and info.value.code == "ERROR_CODE_CANCELLED"
    assert fake.cancels == [stream.id]


async def test_leaving_block_early_sends_cancel_and_waits_for_end(fake: FakeSidecar) -> None:
    with trio.fail_after(10):
        async with open_sidecar(fake.url) as sc:
            async with sc.generate({"prompt": "slow"}) as stream:
                async for _ in stream:
                    break
            # the block waited for the end
            assert stream.end is not None and stream.end.outcome == "cancelled"
            assert fake.cancels == [stream.id]


async def test_cancelling_the_block_sends_cancel_shielded(fake: FakeSidecar) -> None:
    with trio.fail_after(10):
        async with open_sidecar(fake.url) as sc:
            with trio.CancelScope() as scope:
                async with sc.generate({"prompt": "slow"}) as stream:
                    async for _ in stream:
                        scope.cancel(reason="test")
                        await trio.sleep_forever()
            assert scope.cancelled_caught
            assert stream.end is not None and stream.end.outcome == "cancelled"
            assert fake.cancels == [stream.id]


async def test_cancel_wait_is_bounded(fake: FakeSidecar) -> None:
    with trio.fail_after(10):
        async with open_sidecar(fake.url, cancel_timeout=0.2) as sc:
            start = trio.current_time()
            async with sc.generate({"prompt": "deaf"}) as stream:
                async for _ in stream:
                    break
            assert stream.end is None
            assert 0.2 <= trio.current_time() - start < 5
            assert fake.cancels == [stream.id]
            # the connection is still usable
            assert (await sc.call("describe"))["engine"] == "fake"


async def test_user_exception_in_block_cancels_and_propagates_unwrapped(fake: FakeSidecar) -> None:
    with trio.fail_after(10), pytest.raises(KeyError):
        async with open_sidecar(fake.url) as sc, sc.generate({"prompt": "slow"}) as stream:
            async for _ in stream:
                raise KeyError("boom")
    await fake.cancel_seen.wait()
    assert fake.cancels == [stream.id]


@ENCODINGS
async def test_rejected_and_failed(fake: FakeSidecar, encoding: str) -> None:
    with trio.fail_after(10):
        async with open_sidecar(fake.url, encoding=encoding) as sc:
            async with sc.generate({"prompt": "reject"}) as stream:
                assert [e async for e in stream] == []
            assert stream.end is not None and stream.end.outcome == "rejected"
            with pytest.raises(SidecarStreamError) as info:
                stream.check()
            assert info.value.code == "ERROR_CODE_DRAINING" and info.value.retryable

            async with sc.generate({"prompt": "fail"}) as stream:
                events = [e async for e in stream]
            assert events[-1].response.kind == "error"
            assert events[-1].response.error == wire.EngineError(
                code="ERROR_CODE_INTERNAL", message="engine exploded", retryable=True
            )
            end = await stream.wait_end() if stream.end is None else stream.end
            assert end.outcome == "failed" and end.error is not None and end.error.retryable


@ENCODINGS
async def test_call_ok_and_error(fake: FakeSidecar, encoding: str) -> None:
    with trio.fail_after(10):
        async with open_sidecar(fake.url, encoding=encoding) as sc:
            assert await sc.call("describe") == {"engine": "fake", "models": [{"name": "m"}]}
            adapter = pb.LoadLoraRequest(adapter=pb.LoraAdapter(lora_id=1, lora_name="a", source_path="/a"))
            with pytest.raises(SidecarCallError) as info:
                await sc.call("loadLora", adapter)
            err = info.value
            assert (err.method, err.code, err.message, err.retryable) == (
                "loadLora",
                "ERROR_CODE_INVALID_ARGUMENT",
                "bad adapter",
                False,
            )
            # an unknown method: the sidecar answers with a failed result attributed to the call
            with pytest.raises(SidecarCallError) as info:
                await sc.call("launchMissiles")
            assert info.value.code == "ERROR_CODE_UNSUPPORTED_FEATURE"
    calls = [c for c in fake.commands if isinstance(c, CallCommand)]
    assert [c.method for c in calls] == ["describe", "loadLora"]
    assert calls[1].request == adapter


async def test_server_closing_mid_stream(fake: FakeSidecar) -> None:
    with trio.fail_after(10):
        async with open_sidecar(fake.url) as sc:
            async with trio.open_nursery() as nursery:
                call_error: list[BaseException] = []

                async def pending_call() -> None:
                    try:
                        await sc.call("health")  # never answered by the fake
                    except SidecarConnectionError as err:
                        call_error.append(err)

                nursery.start_soon(pending_call)
                async with sc.generate({"prompt": "die"}) as stream:
                    got = []
                    with pytest.raises(SidecarConnectionError) as info:
                        async for event in stream:
                            got.append(event)
                assert len(got) == 1
                assert info.value.close_code == 1011 and "sidecar crashed" in str(info.value)
                assert info.value.retryable
                assert stream.end is None
                with pytest.raises(SidecarConnectionError):
                    stream.check()
            assert len(call_error) == 1
            assert sc.closed
            with pytest.raises(SidecarConnectionError):
                async with sc.generate({"prompt": "hello"}):
                    pass
            with pytest.raises(SidecarConnectionError):
                await sc.call("describe")


async def test_undecodable_frame_from_server_fails_the_connection(fake: FakeSidecar) -> None:
    with trio.fail_after(10):
        async with open_sidecar(fake.url) as sc, sc.generate({"prompt": "garbage"}) as stream:
            with pytest.raises(SidecarConnectionError, match="undecodable"):
                async for _ in stream:
                    pass


async def test_protocol_error_message_is_kept(fake: FakeSidecar) -> None:
    with trio.fail_after(10):
        async with open_sidecar(fake.url) as sc:
            async with sc.generate({"prompt": "protocol"}) as stream:
                await stream.wait_end()
            assert sc.last_protocol_error == "you did something odd"


@ENCODINGS
async def test_kv_session_bytes_both_ways(fake: FakeSidecar, encoding: str) -> None:
    with trio.fail_after(10):
        async with open_sidecar(fake.url, encoding=encoding) as sc:
            async with sc.generate({"prompt": "prefill", "stopping": {"maxTokens": 1}}) as prefill:
                (event,) = [e async for e in prefill]
            assert event.response.kind == "prefillReady"
            assert event.kv_session_bytes == SESSION_BYTES
            assert prefill.kv_session_bytes == SESSION_BYTES
            async with sc.generate({"prompt": "hello"}, kv_session_bytes=prefill.kv_session_bytes) as decode:
                await decode.wait_end()
    cmd = fake.commands[-1]
    assert isinstance(cmd, GenerateCommand)
    assert cmd.kv_session_bytes == SESSION_BYTES
    assert cmd.request.kv is not None and cmd.request.kv.session is not None
    assert cmd.request.kv.session.session_id == "sess"


async def test_connect_failure() -> None:
    with trio.fail_after(10):
        listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
        port = listener.socket.getsockname()[1]
        await listener.aclose()  # nothing listens there now
        with pytest.raises(SidecarConnectionError, match="cannot connect"):
            async with open_sidecar(f"ws://127.0.0.1:{port}", connect_timeout=2):
                pass


class _ReadyHost:
    """What the HTTP app reads from the core."""

    draining = False
    load = None

    def not_ready_reason(self) -> str | None:
        return None

    def current_card(self) -> Any:
        return {}


async def test_the_http_port_is_named_as_the_wrong_port() -> None:
    """``generate`` pointed at the HTTP port said "HTTP 403", which read like an auth problem."""
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(serve_http, build_app(_ReadyHost(), auth_token="t"), "127.0.0.1:0")
            url = f"ws://127.0.0.1:{port}/v1/ws"
            with pytest.raises(SidecarConnectionError) as caught:
                async with open_sidecar(url, connect_timeout=5):
                    pass
            nursery.cancel_scope.cancel()
    assert str(caught.value) == (
        f"cannot connect to {url}: that is the sidecar's HTTP port (probes, metrics), not its "
        "WebSocket port: connect to its --listen address (default port 8600)"
    )


@pytest.mark.parametrize(
    ("status", "body", "said"),
    [
        (403, b"", "refused with HTTP 403 Forbidden: is it the address of a sidecar's --listen"),
        (404, b"no\x1b[31m\nsuch", "HTTP 404 Not Found (no\\x1b[31m\\nsuch): is it the address"),
        (
            503,
            b"too many connections (per-peer)\n",
            "HTTP 503 Service Unavailable (too many connections (per-peer))",
        ),
    ],
)
async def test_a_refused_handshake_says_what_answered(status: int, body: bytes, said: str) -> None:
    """A server that is no sidecar's WebSocket listener (or one at capacity): the status in words,
    its body escaped, and where a sidecar's WebSocket port is unless it was one at capacity."""

    async def refuse(request: WebSocketRequest) -> None:
        await request.reject(status, body=body)

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            server = await nursery.start(serve_websocket, refuse, "127.0.0.1", 0, None)
            url = f"ws://127.0.0.1:{server.port}/v1/ws"
            with pytest.raises(SidecarConnectionError) as caught:
                async with open_sidecar(url, connect_timeout=5):
                    pass
            nursery.cancel_scope.cancel()
    message = str(caught.value)
    assert message.startswith(f"cannot connect to {url}: the WebSocket handshake was refused"), message
    assert said in message, message
    assert "\n" not in message and "\x1b" not in message
    assert ("--listen" in message) == (status != 503), message


async def test_protocol_error_reply_for_bad_request_ends_the_stream(fake: FakeSidecar) -> None:
    """A request the sidecar cannot parse still gets its end (rejected), not a hang."""
    with trio.fail_after(10):
        async with open_sidecar(fake.url) as sc:
            async with sc.generate({"prompt": 5}) as stream:
                assert [e async for e in stream] == []
            assert stream.end is not None and stream.end.outcome == "rejected"
            assert stream.end.error is not None and stream.end.error.code == "ERROR_CODE_INVALID_ARGUMENT"


@ENCODINGS
async def test_coalesced_events(fake: FakeSidecar, encoding: str) -> None:
    with trio.fail_after(10):
        async with open_sidecar(fake.url + "/v1/ws?x=y", encoding=encoding, coalesce=True) as sc:
            async with sc.generate({"prompt": "batch"}) as stream:
                texts = [e.response.text async for e in stream]
            assert texts == ["Hel", "lo", "!"]
            assert stream.end is not None and stream.end.outcome == "completed"
    assert fake.paths == ["/v1/ws?x=y&coalesce=1"]


async def test_auth_token(fake: FakeSidecar) -> None:
    fake.token = "s3cret"
    with trio.fail_after(10):
        with pytest.raises(SidecarConnectionError, match="cannot connect"):
            async with open_sidecar(fake.url):
                pass
        async with open_sidecar(fake.url, auth_token="s3cret") as sc:
            assert (await sc.call("describe"))["engine"] == "fake"
