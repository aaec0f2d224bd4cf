"""The KV event bridge service: engine KV sources in, one ZMQ publisher per DP rank out.

Task tree (docs/design/architecture.md)::

    run_kv_bridge                      # started in the sidecar's root nursery
    └─ nursery
       ├─ per rank: run_rank_publisher # owns PUB; child serve_replay owns the ROUTER (bounded)
       └─ per rank: ingest supervisor  # ZmqIngest (SUB + DEALER) or GrpcIngest (SubscribeKvEvents)

Each rank's ingest sends output batches (payloads ready to publish, ``OutBatch``) into a
bounded memory channel read by that rank's publisher (a slow publisher pauses the ingest; libzmq then queues, and what it drops
comes back through replay). An ingest that crashes on an unexpected error is logged and
restarted after publishing ``AllBlocksCleared``; it never takes the other ranks (or the
sidecar) down. Cancelling the surrounding scope closes every socket (``linger=0``).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Protocol

import trio
import zmq

from sidecar.kvbridge.errors import KvConfigError, KvSourceError
from sidecar.kvbridge.events import OutBatch, cleared_payload
from sidecar.kvbridge.ingest_grpc import GrpcIngest, KvEventClient
from sidecar.kvbridge.ingest_limits import IngestLimits
from sidecar.kvbridge.ingest_zmq import ZmqIngest
from sidecar.kvbridge.metrics import RankMetrics
from sidecar.kvbridge.publisher import RankEndpoints, run_rank_publisher
from sidecar.kvbridge.replay_server import ReplayLimits
from sidecar.kvbridge.sources import GrpcSource, KvSource, ZmqSource, plan_sources
from sidecar.kvbridge.zmqio import rank_endpoint
from sidecar.nursery import open_background_nursery
from sidecar.openengine import pb
from sidecar.openengine.engine_errors import EngineClientError

if TYPE_CHECKING:
    from sidecar.tracing.otel import Tracer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KvBridgeConfig:
    """Bridge settings (CLI: ``--kv-publish``, ``--kv-replay``, ``--kv-buffer-steps``, ``--kv-topic``, ``--kv-hwm``).

    ``publish_endpoint`` / ``replay_endpoint`` are bind endpoints for DP rank 0; rank ``r``
    binds port + ``r`` (``ipc://`` paths get ``_dp<r>``; port 0 gives every rank its own
    ephemeral port). ``replay_endpoint=None`` disables our replay socket. ``dp_ranks``: the
    ranks to bridge (``None``: every rank the engine advertises). ``advertise_host`` replaces
    the host of the reported endpoints (set it when binding a wildcard). ``replay_limits``
    bound our replay ROUTER (``--kv-replay-hwm``, ``--kv-replay-socket-buffer``, ``--kv-replay-max-active``,
    ``--kv-replay-stall-timeout``); ``ingest_limits`` what we take from the engine
    (``--kv-max-batch-bytes``, ``--kv-engine-replay-*``).
    """

    publish_endpoint: str = "tcp://127.0.0.1:5600"
    replay_endpoint: str | None = "tcp://127.0.0.1:5700"
    buffer_steps: int = 10_000
    topic: str = ""
    hwm: int = 100_000
    dp_ranks: tuple[int, ...] | None = None
    advertise_host: str | None = None
    replay_limits: ReplayLimits = field(default_factory=ReplayLimits)
    ingest_limits: IngestLimits = field(default_factory=IngestLimits)
    replay_timeout: float = 5.0
    queue_size: int = 256
    backoff_initial: float = 0.05
    backoff_max: float = 5.0
    discovery_timeout: float = 30.0
    #: ZMQ sources: heartbeat (ZMTP PING) interval on the SUB connection; a connection silent
    #: for 3 intervals is dropped and made again (0: off; ingest_zmq.py).
    zmq_heartbeat: float = 2.0
    #: ZMQ sources: after this many seconds without a batch, ask the engine's replay for what
    #: follows the last one (0: never; ingest_zmq.py).
    silence_probe: float = 10.0
    #: Seconds without a batch before the last one is published again (0: never; publisher.py;
    #: ``run --kv-heartbeat`` defaults to 5).
    heartbeat: float = 0.0

    def validate(self) -> None:
        """Raise :class:`KvConfigError` for unusable settings."""
        if self.buffer_steps < 1:
            raise KvConfigError("--kv-buffer-steps must be at least 1")
        if self.hwm < 0:
            raise KvConfigError("--kv-hwm must be >= 0")
        if self.heartbeat < 0:
            raise KvConfigError("--kv-heartbeat must be >= 0")
        if self.queue_size < 1:
            raise KvConfigError("queue_size must be at least 1")
        if problems := self.ingest_limits.problems():
            raise KvConfigError("; ".join(problems))
        rl = self.replay_limits
        if (
            rl.hwm < 1
            or rl.max_active < 1
            or rl.socket_buffer < 4096
            or not (rl.stall_timeout > 0 and math.isfinite(rl.stall_timeout))
        ):
            raise KvConfigError(
                "--kv-replay-hwm and --kv-replay-max-active must be >= 1, --kv-replay-socket-buffer >= 4096, "
                "--kv-replay-stall-timeout a positive number"
            )
        for v, name in ((self.replay_timeout, "replay_timeout"), (self.backoff_initial, "backoff_initial")):
            if not (v > 0 and math.isfinite(v)):
                raise KvConfigError(f"{name} must be a positive number")
        rank_endpoint(self.publish_endpoint, 0)
        if self.replay_endpoint is not None:
            rank_endpoint(self.replay_endpoint, 0)
            if self.replay_endpoint == self.publish_endpoint and not self.publish_endpoint.endswith(":0"):
                raise KvConfigError("--kv-replay must differ from --kv-publish")


@dataclass(frozen=True)
class KvRankInfo:
    """One bridged rank: where we publish, and where its events come from."""

    rank: int
    publish_endpoint: str
    replay_endpoint: str | None
    source: str  # "zmq" | "grpc"
    source_endpoint: str | None = None


@dataclass(frozen=True)
class KvBridgeInfo:
    """What ``run_kv_bridge`` reports once every socket is bound (for the worker card)."""

    topic: str
    buffer_steps: int
    ranks: tuple[KvRankInfo, ...] = field(default_factory=tuple)

    def to_dict(self) -> dict[str, object]:
        """JSON-ready form: ``{"format": "vllm-zmq", "topic", "bufferSteps", "ranks": [...]}``."""
        return {
            "format": "vllm-zmq",
            "topic": self.topic,
            "bufferSteps": self.buffer_steps,
            "ranks": [
                {
                    "dpRank": r.rank,
                    "publishEndpoint": r.publish_endpoint,
                    "replayEndpoint": r.replay_endpoint,
                    "source": r.source,
                    "sourceEndpoint": r.source_endpoint,
                }
                for r in self.ranks
            ],
        }


async def discover_sources(client: KvEventClient, config: KvBridgeConfig) -> list[KvSource]:
    """``GetKvEventSources`` + :func:`plan_sources`; retries an unreachable engine until
    ``discovery_timeout``. Raises :class:`KvSourceError` (also on timeout) or the client's
    non-retryable error (e.g. ``EngineStatusError`` UNIMPLEMENTED: no KV event sources)."""
    req = pb.GetKvEventSourcesRequest(data_parallel_ranks=list(config.dp_ranks or ()))
    delay = config.backoff_initial
    deadline = trio.current_time() + config.discovery_timeout
    while True:
        try:
            with trio.fail_after(max(0.0, deadline - trio.current_time())):
                resp = await client.get_kv_event_sources(req)
            break
        except trio.TooSlowError:
            raise KvSourceError(
                f"GetKvEventSources did not answer within {config.discovery_timeout} s"
            ) from None
        except EngineClientError as err:
            if not err.retryable or trio.current_time() + delay > deadline:
                raise
            log.info("KV event source discovery failed (%s); retrying", err)
            await trio.sleep(delay)
            delay = min(delay * 2, config.backoff_max)
    return plan_sources(resp, config.dp_ranks)


class _Ingest(Protocol):
    async def run(self) -> None: ...

    def cleared(self) -> OutBatch: ...


async def _supervise(
    make: Callable[..., _Ingest], rank: int, out: trio.MemorySendChannel[list[OutBatch]], backoff: float
) -> None:
    """Run ``make().run`` forever; an unexpected crash is logged, resynced (``AllBlocksCleared``
    in the crashed ingest's form) and restarted."""
    cleared = False
    while True:
        ingest: _Ingest | None = None
        try:
            ingest = make(cleared=cleared)
            await ingest.run()
            return
        except Exception:
            log.exception("KV rank %d: ingest crashed; resyncing and restarting", rank)
            RankMetrics(rank).resync("ingest_restart")
            if ingest is not None:
                batch = ingest.cleared()
            else:
                now = time.time()
                batch = OutBatch(cleared_payload(now, rank), 1, now)
            await out.send([batch])
            cleared = True
            await trio.sleep(backoff)


async def run_kv_bridge(
    config: KvBridgeConfig,
    *,
    engine_client: KvEventClient | None = None,
    sources: Sequence[KvSource] | None = None,
    tracer: Tracer | None = None,
    task_status: trio.TaskStatus[KvBridgeInfo] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the bridge until cancelled: ``await nursery.start(partial(run_kv_bridge, config, engine_client=c))``.

    ``sources``: the per-rank sources to use; ``None`` discovers them through
    ``engine_client.get_kv_event_sources`` (:func:`discover_sources`). ``engine_client`` is
    also what ``grpc`` sources subscribe through. ``tracer``: replays and resyncs become spans
    (``sidecar.kvbridge.spans``). Reports :class:`KvBridgeInfo` once every
    PUB/ROUTER socket is bound and every ingest started.

    Raises (before reporting): :class:`KvConfigError` / :class:`KvSourceError` for bad
    settings or discovery, ``OSError`` when an endpoint cannot be bound, the client's
    ``EngineClientError`` when discovery fails for good.
    """
    config.validate()
    if sources is None:
        if engine_client is None:
            raise KvConfigError("run_kv_bridge needs sources or an engine_client to discover them")
        plan = await discover_sources(engine_client, config)
    else:
        plan = list(sources)
    ranks = [s.rank for s in plan]
    if not plan or len(set(ranks)) != len(ranks) or min(ranks) < 0:
        raise KvConfigError(f"KV sources must name distinct DP ranks, got {ranks}")
    if engine_client is None and any(isinstance(s, GrpcSource) for s in plan):
        raise KvConfigError("grpc KV sources need an engine_client")
    for s in plan:  # fail before binding anything
        rank_endpoint(config.publish_endpoint, s.rank)
        if config.replay_endpoint is not None:
            rank_endpoint(config.replay_endpoint, s.rank)

    ctx = zmq.Context()
    try:
        async with open_background_nursery() as nursery:  # a bind failure at start: as itself
            infos: list[KvRankInfo] = []
            for src in plan:
                send, receive = trio.open_memory_channel[list[OutBatch]](config.queue_size)
                ep: RankEndpoints = await nursery.start(
                    partial(
                        run_rank_publisher,
                        ctx,
                        src.rank,
                        receive,
                        publish_endpoint=rank_endpoint(config.publish_endpoint, src.rank),
                        replay_endpoint=(
                            rank_endpoint(config.replay_endpoint, src.rank)
                            if config.replay_endpoint
                            else None
                        ),
                        topic=config.topic,
                        buffer_steps=config.buffer_steps,
                        hwm=config.hwm,
                        advertise_host=config.advertise_host,
                        replay_limits=config.replay_limits,
                        heartbeat=config.heartbeat,
                    )
                )
                make: Callable[..., _Ingest]
                if isinstance(src, ZmqSource):
                    make = partial(
                        ZmqIngest,
                        ctx,
                        src,
                        send,
                        hwm=config.hwm,
                        replay_timeout=config.replay_timeout,
                        limits=config.ingest_limits,
                        zmq_heartbeat=config.zmq_heartbeat,
                        silence_probe=config.silence_probe,
                        tracer=tracer,
                    )
                    source_ep: str | None = src.endpoint
                else:
                    assert engine_client is not None  # refused above otherwise
                    make = partial(
                        GrpcIngest,
                        engine_client,
                        src,
                        send,
                        backoff_initial=config.backoff_initial,
                        backoff_max=config.backoff_max,
                        limits=config.ingest_limits,
                        tracer=tracer,
                    )
                    source_ep = None
                nursery.start_soon(_supervise, make, src.rank, send, config.backoff_max)
                infos.append(
                    KvRankInfo(src.rank, ep.publish_endpoint, ep.replay_endpoint, src.transport, source_ep)
                )
                log.info(
                    "KV rank %d: %s source %s -> publish %s, replay %s",
                    src.rank,
                    src.transport,
                    source_ep or "SubscribeKvEvents",
                    ep.publish_endpoint,
                    ep.replay_endpoint or "off",
                )
            task_status.started(KvBridgeInfo(config.topic, config.buffer_steps, tuple(infos)))
    finally:
        ctx.destroy(linger=0)
