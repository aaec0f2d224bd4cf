"""Regressions found by the reliability tests, pinned at unit level (real grpclib engine over
loopback, the fake engine of tests/openengine)."""

from __future__ import annotations

import trio

from sidecar.core.lifecycle import OUTCOME_CLIENT_GONE, ClientGone, LifecycleConfig, StreamSupervisor
from sidecar.openengine import pb
from sidecar.openengine.client import open_engine_client
from tests.openengine.fake_grpc_engine import Gate, RunningServer, tokens


async def test_client_gone_raised_inside_a_cancelled_connection_is_contained(server: RunningServer) -> None:
    """The WebSocket plane, on a client stalled past --stall-timeout, cancels the whole
    connection's scope and then raises ClientGone from ``emit``. It once escaped (inside an
    exception group) and crashed the sidecar's WebSocket server, every connection with it; now the
    stream ends cancelled ("client connection closed"), is aborted, and nothing escapes."""
    gate = Gate()
    server.engine.streams["Generate"] = lambda r, md: [*tokens(r.request_id, 2)[:1], gate]
    async with (
        open_engine_client(server.address) as client,
        trio.open_nursery() as nursery,
    ):
        sup = StreamSupervisor(client, LifecycleConfig(abort_timeout=1.0, abort_retry_window=2.0))
        await nursery.start(sup.run_service)
        connection = trio.CancelScope()

        async def emit(ev: pb.GenerateResponse) -> None:
            connection.cancel()  # what Connection._close does on a stall ...
            raise ClientGone  # ... before send() raises this

        with trio.fail_after(5):
            with connection:
                outcome = await sup.run(
                    sup.admit(pb.GenerateRequest(request_id="r1", model="m", prompt="hi")), emit
                )
            assert outcome == OUTCOME_CLIENT_GONE
            aborts = [s.request.request_id for s in server.engine.seen if s.route == "Abort"]
            assert aborts == ["r1"]
            assert sup.streams == {}
        nursery.cancel_scope.cancel()
