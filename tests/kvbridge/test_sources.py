"""plan_sources: discovery -> one validated source per DP rank."""

from __future__ import annotations

import pytest

from sidecar.kvbridge.errors import KvSourceError
from sidecar.kvbridge.sources import GrpcSource, ZmqSource, plan_sources
from sidecar.openengine import pb


def zmq_src(rank: int | None, host: str = "10.0.0.5", port: int = 5557, **kw: object) -> pb.KvEventSource:
    return pb.KvEventSource(
        transport="zmq",
        endpoint_addr=pb.KvEndpoint(host=host, port=port, protocol=str(kw.pop("protocol", "tcp"))),
        topic=str(kw.pop("topic", "")),
        replay_endpoint=str(kw.pop("replay", "")),
        data_parallel_rank=rank,
        encoding=str(kw.pop("encoding", "msgpack")),
        hwm=kw.pop("hwm", None),  # type: ignore[arg-type]
    )


def grpc_src(rank: int | None, **kw: object) -> pb.KvEventSource:
    return pb.KvEventSource(
        transport="grpc", data_parallel_rank=rank, encoding=str(kw.get("encoding", "protobuf"))
    )


def resp(*sources: pb.KvEventSource) -> pb.GetKvEventSourcesResponse:
    # through the wire, as a client would see it
    return pb.GetKvEventSourcesResponse.parse(bytes(pb.GetKvEventSourcesResponse(sources=list(sources))))


def test_zmq_per_rank_with_replay_and_topic() -> None:
    plan = plan_sources(
        resp(
            zmq_src(1, port=5558, replay="tcp://*:5601", topic="kv", hwm=5),
            zmq_src(0, replay="tcp://10.0.0.5:5600", topic="kv"),
        ),
        [0, 1],
    )
    assert plan == [
        ZmqSource(0, "tcp://10.0.0.5:5557", "kv", "tcp://10.0.0.5:5600"),
        ZmqSource(1, "tcp://10.0.0.5:5558", "kv", "tcp://10.0.0.5:5601", 5),
    ]


def test_grpc_preferred_over_zmq_and_rankless_grpc_covers_all() -> None:
    plan = plan_sources(resp(zmq_src(0), zmq_src(1, port=5558), grpc_src(None)), [0, 1])
    assert plan == [GrpcSource(0), GrpcSource(1)]
    plan = plan_sources(resp(zmq_src(0), grpc_src(1, encoding="")), [0, 1])
    assert plan == [ZmqSource(0, "tcp://10.0.0.5:5557"), GrpcSource(1)]


def test_grpc_source_endpoint_checked_when_present() -> None:
    src = pb.KvEventSource(
        transport="grpc",
        endpoint_addr=pb.KvEndpoint(host="10.0.0.5", port=50051, protocol="grpc"),
        data_parallel_rank=0,
        encoding="protobuf",
    )
    assert plan_sources(resp(src), [0]) == [GrpcSource(0)]
    src.endpoint_addr.host = "0.0.0.0"  # type: ignore[union-attr]
    assert plan_sources(resp(src, zmq_src(0)), [0]) == [ZmqSource(0, "tcp://10.0.0.5:5557")]
    with pytest.raises(KvSourceError, match="not routable"):
        plan_sources(resp(src), [0])


def test_rankless_zmq_for_a_single_rank_and_inferred_ranks() -> None:
    assert plan_sources(resp(zmq_src(None)), [3]) == [ZmqSource(3, "tcp://10.0.0.5:5557")]
    assert plan_sources(resp(zmq_src(None))) == [ZmqSource(0, "tcp://10.0.0.5:5557")]
    assert [s.rank for s in plan_sources(resp(zmq_src(2), zmq_src(5, port=1)))] == [2, 5]


def test_ipv6_and_bare_replay_endpoints() -> None:
    (s,) = plan_sources(resp(zmq_src(0, host="fd00::1", replay="[::]:6000")), [0])
    assert s == ZmqSource(0, "tcp://[fd00::1]:5557", "", "tcp://[fd00::1]:6000")
    (s,) = plan_sources(resp(zmq_src(0, replay="ipc:///tmp/replay")), [0])
    assert isinstance(s, ZmqSource) and s.replay_endpoint == "ipc:///tmp/replay"


def test_unknown_transport_ignored_when_rank_is_covered() -> None:
    other = pb.KvEventSource(transport="nats", data_parallel_rank=0, encoding="json")
    assert plan_sources(resp(other, zmq_src(0)), [0]) == [ZmqSource(0, "tcp://10.0.0.5:5557")]


@pytest.mark.parametrize(
    ("sources", "ranks", "fragment"),
    [
        ((zmq_src(0, host="0.0.0.0"),), [0], "not routable"),
        ((zmq_src(0, host="*"),), [0], "not routable"),
        ((zmq_src(0, host="::"),), [0], "not routable"),
        ((zmq_src(0, host=""),), [0], "not routable"),
        ((zmq_src(0, port=0),), [0], "port 0"),
        ((zmq_src(0, protocol="udp"),), [0], "protocol 'udp'"),
        ((zmq_src(0, protocol="grpc"),), [0], "protocol 'grpc'"),
        ((zmq_src(0, encoding="json"),), [0], "encoding 'json'"),
        ((grpc_src(0, encoding="msgpack"),), [0], "encoding 'msgpack'"),
        ((zmq_src(0, replay="http://x:1"),), [0], "replay endpoint"),
        ((zmq_src(0, replay="tcp://x"),), [0], "no valid port"),
        (
            (pb.KvEventSource(transport="zmq", data_parallel_rank=0, encoding="msgpack"),),
            [0],
            "no endpoint_addr",
        ),
        ((zmq_src(0),), [0, 1], "rank 1 has no usable source"),
        ((zmq_src(0), zmq_src(0, port=9)), [0], "rank 0 has 2 zmq sources"),
        ((zmq_src(0), zmq_src(7)), [0], "rank 7 is not one of"),
        ((zmq_src(None),), [0, 1], "without data_parallel_rank"),
        ((pb.KvEventSource(transport="nats", data_parallel_rank=0),), [0], "unknown transport 'nats'"),
        ((), [0], "rank 0 has no usable source"),
    ],
)
def test_invalid_discovery_is_a_typed_error(sources: tuple, ranks: list[int], fragment: str) -> None:
    with pytest.raises(KvSourceError) as info:
        plan_sources(resp(*sources), ranks)
    assert fragment in str(info.value)
    assert info.value.problems


def test_every_problem_is_reported() -> None:
    with pytest.raises(KvSourceError) as info:
        plan_sources(resp(zmq_src(0, host="0.0.0.0"), zmq_src(1, encoding="x")), [0, 1])
    assert len(info.value.problems) == 2
