"""The wait for Dynamo's planes before its runtime is built (sidecar/dynamo/reachability.py)."""

from __future__ import annotations

import pytest
import trio

from sidecar.dynamo.config import DynamoConfig
from sidecar.dynamo.reachability import PlaneServer, PlanesUnreachable, plane_servers, wait_for_planes
from tests.dynamo.planes import free_port


def test_servers_follow_the_planes_and_dynamo_variables() -> None:
    env = {
        "ETCD_ENDPOINTS": "http://10.0.0.1:2379, https://etcd-b:2380,etcd-c",
        "NATS_SERVER": "nats://n:4333",
    }
    assert plane_servers(DynamoConfig(), env) == {
        "etcd": [
            PlaneServer("etcd", "http://10.0.0.1:2379", "10.0.0.1", 2379),
            PlaneServer("etcd", "https://etcd-b:2380", "etcd-b", 2380),
            PlaneServer("etcd", "etcd-c", "etcd-c", 2379),
        ]
    }
    both = plane_servers(DynamoConfig(request_plane="nats", discovery_backend="kubernetes"), env)
    assert both == {"NATS": [PlaneServer("NATS", "nats://n:4333", "n", 4333)]}
    defaults = plane_servers(DynamoConfig(event_plane="nats"), {})
    assert [s.url for s in defaults["etcd"]] == ["http://localhost:2379"]
    assert [s.url for s in defaults["NATS"]] == ["nats://localhost:4222"]
    assert plane_servers(DynamoConfig(discovery_backend="file"), env) == {}


async def test_waits_until_a_server_listens_and_gives_up_at_the_deadline() -> None:
    port = free_port()
    servers = {"etcd": [PlaneServer("etcd", f"http://127.0.0.1:{port}", "127.0.0.1", port)]}
    seen: list[str] = []
    with trio.fail_after(10):
        with pytest.raises(
            PlanesUnreachable, match=r"etcd \(http://127.0.0.1:\d+: connection refused\) unreachable for 0.6s"
        ):
            await wait_for_planes(servers, 0.6, waiting=seen.append)
        assert seen and seen[0].startswith("waiting for etcd")
        async with trio.open_nursery() as nursery:
            listener = (await trio.open_tcp_listeners(port, host="127.0.0.1"))[0]
            nursery.start_soon(trio.serve_listeners, lambda s: s.aclose(), [listener])
            await wait_for_planes(servers, 5)
            nursery.cancel_scope.cancel()
