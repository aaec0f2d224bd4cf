"""KV event bridge: engine KV events (ZMQ msgpack or OpenEngine gRPC) -> one ZMQ publisher per DP rank, events as the engine wrote them.

Public API (see docs/KVBRIDGE.md)::

    from sidecar.kvbridge import KvBridgeConfig, run_kv_bridge
    info = await nursery.start(partial(run_kv_bridge, KvBridgeConfig(...), engine_client=client))
    info.to_dict()   # for the worker card
"""

from sidecar.kvbridge.errors import KvBridgeError, KvConfigError, KvDecodeError, KvSourceError
from sidecar.kvbridge.ingest_limits import IngestLimits
from sidecar.kvbridge.replay_server import ReplayLimits
from sidecar.kvbridge.service import KvBridgeConfig, KvBridgeInfo, KvRankInfo, discover_sources, run_kv_bridge
from sidecar.kvbridge.sources import GrpcSource, KvSource, ZmqSource, plan_sources

__all__ = [
    "GrpcSource",
    "IngestLimits",
    "KvBridgeConfig",
    "KvBridgeError",
    "KvBridgeInfo",
    "KvConfigError",
    "KvDecodeError",
    "KvRankInfo",
    "KvSource",
    "KvSourceError",
    "ReplayLimits",
    "ZmqSource",
    "discover_sources",
    "plan_sources",
    "run_kv_bridge",
]
