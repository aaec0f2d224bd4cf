"""sidecar.client against a real sidecar and simulated engine: cancelling the scope around
``open_sidecar`` with streams open finishes promptly (RELIABILITY gap 3), and the sidecar
still cancels and aborts those streams (the engine ends holding nothing)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from sidecar.client import SidecarConnectionError, SidecarStream, open_sidecar
from tests.client.fake_sidecar import FakeSidecar
from tests.e2e.harness import generate_request, mock_engine, sidecar, wait_engine_idle

STREAMS = 8
CANCEL_TIMEOUT = 30.0  # what each stream would wait for its end, were the fix missing


@pytest.mark.subprocess
async def test_cancelling_scope_around_open_sidecar_with_open_streams_is_prompt(
    aio_loop: Any, tmp_path: Path
) -> None:
    with trio.fail_after(30):
        async with (
            mock_engine(tmp_path, "--token-delay-ms", "20") as engine,
            sidecar(engine.address) as sc,
        ):
            streams: list[SidecarStream] = []
            all_started = trio.Event()
            guard = trio.CancelScope()  # fail_after(5) from the moment of the cancel
            with guard, trio.CancelScope() as outer:
                async with open_sidecar(sc.ws, cancel_timeout=CANCEL_TIMEOUT) as client:

                    async def one(i: int) -> None:
                        request = generate_request(max_tokens=2000, requestId=f"scope-{i}")
                        async with client.generate(request) as stream:
                            streams.append(stream)
                            async for _ in stream:
                                if len(streams) == STREAMS and not all_started.is_set():
                                    all_started.set()

                    async with trio.open_nursery() as nursery:
                        for i in range(STREAMS):
                            nursery.start_soon(one, i)
                        await all_started.wait()
                        cancelled_at = trio.current_time()
                        guard.deadline = cancelled_at + 5.0
                        outer.cancel(reason="test: scope around open_sidecar cancelled")
            took = trio.current_time() - cancelled_at
            assert not guard.cancelled_caught, "still waiting 5 s after the cancel"
            assert outer.cancelled_caught
            # Without the fix each stream waits its whole cancel_timeout (30 s).
            assert took < 5.0, f"leaving took {took:.2f}s"
            assert len(streams) == STREAMS
            for stream in streams:
                assert stream.end is None  # the end could not arrive: the reader was gone
                with pytest.raises(SidecarConnectionError):
                    stream.check()
            # The sidecar saw the connection close: it cancelled and aborted every stream.
            counters = await wait_engine_idle(engine.address, timeout=10)
            assert counters["requests_leaked"] == 0


async def test_cancelling_scope_around_open_sidecar_with_deaf_streams(fake: FakeSidecar) -> None:
    """Against the fake sidecar (``deaf``: no end ever follows a cancel): the same, without processes."""
    with trio.fail_after(5):
        streams: list[SidecarStream] = []
        with trio.CancelScope() as outer:
            async with open_sidecar(fake.url, cancel_timeout=CANCEL_TIMEOUT) as client:

                async def one() -> None:
                    async with client.generate({"prompt": "deaf"}) as stream:
                        streams.append(stream)
                        async for _ in stream:
                            if len(streams) == 3:
                                outer.cancel(reason="test")

                async with trio.open_nursery() as nursery:
                    for _ in range(3):
                        nursery.start_soon(one)
        assert outer.cancelled_caught and len(streams) == 3
        assert all(s.end is None for s in streams)
