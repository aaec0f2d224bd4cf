"""One admitted OpenAI request's exchange with its client (``routes._Exchange``), driven through
its ASGI ``receive``/``send`` with a scripted stream: the order of its writes against its
disconnect watch (the listener and the engine end to end: tests/e2e/test_openai.py)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, cast

import pytest
import trio
import trio.testing

from sidecar.core.lifecycle import COMPLETED, OUTCOME_CLIENT_GONE, OUTCOME_COMPLETED, Outcome, StreamHandle
from sidecar.north.openai.api_errors import ApiError
from sidecar.north.openai.request_map import map_completion
from sidecar.north.openai.routes import OpenAIConfig, OpenAIHost, _Exchange, read_body
from sidecar.openengine import pb
from tests.dynamo.helpers import mock_card
from tests.north.test_openai_front import completion, finished, token

Emit = Callable[[pb.GenerateResponse], Awaitable[None]]


class Client:
    """The ASGI side: ``receive`` blocks like a client that sends nothing more (``watching``
    while it does) until :meth:`disconnect`; ``send`` records each message with whether the
    watch was in ``receive`` then."""

    def __init__(self) -> None:
        self.watching = False
        self.sent: list[tuple[MutableMapping[str, Any], bool]] = []
        self.gone = trio.Event()

    async def receive(self) -> dict[str, Any]:
        self.watching = True
        try:
            await self.gone.wait()
            return {"type": "http.disconnect"}
        finally:
            self.watching = False

    async def send(self, message: MutableMapping[str, Any]) -> None:
        self.sent.append((message, self.watching))

    def disconnect(self) -> None:
        self.gone.set()


class Host:
    """``run_stream`` relaying scripted events, then completing (or waiting for cancellation
    after them with ``hang``)."""

    def __init__(self, events: list[pb.GenerateResponse], *, hang: bool = False) -> None:
        self.events = events
        self.hang = hang
        self.outcome: Outcome | None = None

    async def run_stream(self, handle: StreamHandle, emit: Emit) -> Outcome:
        with handle.scope:
            for ev in self.events:
                await trio.testing.wait_all_tasks_blocked()  # each event comes later, from the engine
                await emit(ev)
            if self.hang:
                await trio.sleep_forever()
        self.outcome = handle.cancel_reason or OUTCOME_COMPLETED
        return self.outcome


def exchange(client: Client) -> _Exchange:
    mapped = map_completion(
        completion(stream=True, stream_options={"include_usage": True}), mock_card(), {"x-request-id": "r-1"}
    )
    return _Exchange(OpenAIConfig(), StreamHandle(mapped.request), mapped, False, client.receive, client.send)


async def test_the_end_of_a_response_is_written_after_its_disconnect_watch_ended() -> None:
    """Nothing of the request is left once the client has its ``[DONE]``: a keep-alive client's
    next request on the connection is read at once, not after this request's task exits."""
    client = Client()
    host = Host([token(0, "Hi"), finished(0, pb.FinishReason.STOP, usage=True)])
    with trio.fail_after(5):
        await exchange(client).run(cast(OpenAIHost, host))
    assert host.outcome is not None and host.outcome.kind == COMPLETED
    (last, watched_at_end), body = client.sent[-1], client.sent[1:]
    assert last["type"] == "http.response.body" and not last.get("more_body")
    assert last["body"].endswith(b"data: [DONE]\n\n") and b'"usage"' in last["body"]
    assert not watched_at_end
    # the token's chunk left while the stream ran, watched
    assert [(m["body"].count(b'"text":"Hi"'), w) for m, w in body[:-1]] == [(1, True)]


async def test_a_client_gone_mid_stream_cancels_it_and_gets_no_end() -> None:
    client = Client()
    host = Host([token(0, "Hi")], hang=True)
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(exchange(client).run, cast(OpenAIHost, host))
            while not (client.sent and client.watching):
                await trio.testing.wait_all_tasks_blocked()
            client.disconnect()
    assert host.outcome is OUTCOME_CLIENT_GONE
    assert all(m.get("more_body", False) for m, _ in client.sent if m["type"] == "http.response.body")


class Body:
    """An ASGI ``receive`` giving ``chunks`` (``more_body`` on each), then blocking: a body
    whose end-of-body message has not been delivered yet."""

    def __init__(self, *chunks: bytes) -> None:
        self.chunks = list(chunks)

    async def receive(self) -> dict[str, Any]:
        if self.chunks:
            return {"type": "http.request", "body": self.chunks.pop(0), "more_body": True}
        await trio.sleep_forever()
        raise AssertionError("unreachable")


async def test_a_body_is_complete_once_its_content_length_arrived() -> None:
    with trio.fail_after(5):
        assert await read_body(Body(b'{"a":', b"1}").receive, OpenAIConfig(), "7") == b'{"a":1}'


async def test_a_body_without_a_length_waits_for_its_end() -> None:
    done = False

    async def read() -> None:
        nonlocal done
        await read_body(Body(b"{}").receive, OpenAIConfig(), None)
        done = True

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read)
            await trio.testing.wait_all_tasks_blocked()  # the end never comes
            assert not done
            nursery.cancel_scope.cancel()
    with pytest.raises(ApiError) as info:
        await read_body(Body(b"{}").receive, OpenAIConfig(body_timeout=0.01), "5")
    assert info.value.status == 408  # a length not reached is still bounded by the body timeout
