"""KV event publishing of the simulated vLLM / SGLang engines over ZMQ (asyncio).

Wire format and faults: ``sidecar.mock.kvevents_wire``. gRPC (``SubscribeKvEvents``,
trtllm flavour): ``sidecar.mock.kvevents_grpc``.

Integration (for the engine)::

    events = ZmqKvEvents(ranks=range(dp_size), bind_host=host, port=kv_port,
                         style="vllm" | "sglang", faults=KvFaults.from_options(pairs))
    caches = [KvCache(r, block_size, total_blocks, events, ground_truth=gt) for r in ...]
    async with events:                 # binds every socket, serves replay; closes on exit
        ...                            # GetKvEventSources -> events.sources(request.data_parallel_ranks)
                                       # or kv_event_sources(events, ranks) (None -> empty answer)

Per DP rank r (one :class:`ZmqKvPublisher`): an XPUB socket (a PUB to subscribers;
XPUB only so tests can wait for a subscription) bound on ``port + r`` and a replay
ROUTER on ``replay_port + r`` (``replay_port`` defaults to ``port + 100``). Port 0
binds each socket to an ephemeral port; ``sources()`` always tells the real ones.
A replay request ``[b"", start_seq (8 bytes BE)]`` gets ``[b"", topic, seq,
payload]`` for every held batch with ``seq >= start`` (SGLang style: no topic
frame), then the end marker ``[b"", b"", 0xFF*8, b""]`` (SGLang: ``[b"", 0xFF*8,
b""]``); a start older than the buffer starts at the oldest held batch. Malformed
requests are logged and ignored.

``publish()`` is synchronous and never blocks (a subscriber past the HWM loses
batches, as with real engines); it must run on the event loop thread. Outside
``async with`` batches are numbered and buffered but not sent. Advertised hosts are routable: a wildcard bind (``0.0.0.0``,
``*``, ``::``) is advertised as ``advertise_host`` or this machine's address.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, cast

import zmq
import zmq.asyncio

from sidecar.mock.kvevents_model import KvEventRecord
from sidecar.mock.kvevents_wire import (
    END_SEQ,
    BatchHistory,
    KvFaults,
    KvSequencer,
    Style,
    encode_payload,
    seq_bytes,
)
from sidecar.openengine import pb

if TYPE_CHECKING:
    from sidecar.mock.kvevents_grpc import GrpcKvEvents

__all__ = [
    "UnknownDpRank",
    "ZmqKvEvents",
    "ZmqKvPublisher",
    "kv_event_sources",
    "routable_host",
]

logger = logging.getLogger(__name__)

_WILDCARDS = frozenset({"", "*", "0.0.0.0", "::", "[::]"})


class UnknownDpRank(ValueError):
    """A request named a data-parallel rank this engine does not have (answer INVALID_ARGUMENT)."""


def routable_host(bind_host: str, advertise_host: str | None = None) -> str:
    """A host clients can connect to: ``advertise_host``, else ``bind_host`` unless it is a wildcard."""
    if advertise_host:
        return advertise_host
    if bind_host.strip("[]").lower() not in _WILDCARDS:
        return bind_host.strip("[]")
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return socket.gethostname()


def _zmq_host(host: str) -> str:
    h = host.strip("[]")
    if h in _WILDCARDS:
        return "*"
    return f"[{h}]" if ":" in h else h


def _bind(sock: zmq.asyncio.Socket, host: str, port: int) -> int:
    if port == 0:
        sock.bind(f"tcp://{_zmq_host(host)}:*")
    else:
        sock.bind(f"tcp://{_zmq_host(host)}:{port}")
    endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    return int(endpoint.rsplit(":", 1)[1])


class ZmqKvPublisher:
    """One DP rank's publisher: XPUB (live batches) + ROUTER (replay) + the replay buffer.

    Sockets are created by :meth:`bind`, served by :meth:`run` (replay requests and
    subscription notices, until cancelled) and closed (``linger=0``) by :meth:`close`.
    """

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        dp_rank: int,
        *,
        bind_host: str = "127.0.0.1",
        advertise_host: str | None = None,
        port: int = 5557,
        replay_port: int | None = None,
        topic: str = "",
        style: Style = "vllm",
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        faults: KvFaults | None = None,
    ) -> None:
        self._ctx = ctx
        self.dp_rank = dp_rank
        self.bind_host = bind_host
        self.host = routable_host(bind_host, advertise_host)
        self.port = port
        self.replay_port = replay_port
        self.topic = topic
        self._topic = topic.encode("utf-8")
        self.style: Style = style
        self.buffer_steps = buffer_steps
        self.hwm = hwm
        self.faults = faults or KvFaults()
        self.sequencer: KvSequencer[bytes] = KvSequencer(BatchHistory(buffer_steps), self.faults)
        self.subscriptions_seen = 0
        self.dropped_live = 0
        self._sub_event = asyncio.Event()
        self._pub: zmq.asyncio.Socket | None = None
        self._router: zmq.asyncio.Socket | None = None

    # ---- lifecycle
    def bind(self) -> None:
        pub = self._ctx.socket(zmq.XPUB)
        pub.setsockopt(zmq.SNDHWM, self.hwm)
        pub.setsockopt(zmq.XPUB_VERBOSE, 1)
        pub.setsockopt(zmq.LINGER, 0)
        self._pub = pub
        self.port = _bind(pub, self.bind_host, self.port)
        if self.replay_port is not None:
            router = self._ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            self._router = router
            self.replay_port = _bind(router, self.bind_host, self.replay_port)
        logger.debug("KV events rank %d: PUB port %d, replay %s", self.dp_rank, self.port, self.replay_port)

    async def run(self) -> None:
        """Serve replay requests and watch subscriptions until cancelled."""
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._watch_subscriptions())
            if self._router is not None:
                tg.create_task(self._serve_replay())

    def close(self) -> None:
        for sock in (self._pub, self._router):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._router = None

    # ---- publishing
    def publish(self, events: Sequence[KvEventRecord]) -> int:
        """Number, buffer and send one batch (unless a fault drops it live); returns its seq."""
        payload = encode_payload(
            time.time(),
            events,
            self.dp_rank + self.faults.rank_offset,
            style=self.style,
            tagged_arrays=self.faults.tagged_arrays,
            undecodable=self.faults.undecodable and self.sequencer.next_seq == 0,
        )
        decision = self.sequencer.next_batch(payload)
        if decision.restarted:
            logger.warning("KV events rank %d: simulated publisher restart (seq back to 0)", self.dp_rank)
        if not decision.send_live:
            logger.warning(
                "KV events rank %d: fault drops batch %d from the live stream", self.dp_rank, decision.seq
            )
            return decision.seq
        if self._pub is None:  # closed (engine shutting down) or never bound: buffered only
            logger.debug("KV events rank %d: batch %d not sent, publisher closed", self.dp_rank, decision.seq)
            return decision.seq
        fut = self._pub.send_multipart([self._topic, seq_bytes(decision.seq), payload], flags=zmq.NOBLOCK)
        cast("asyncio.Future[Any]", fut).add_done_callback(self._sent)
        return decision.seq

    def _sent(self, fut: asyncio.Future[Any]) -> None:
        if fut.cancelled():
            return
        if isinstance(fut.exception(), zmq.Again):
            self.dropped_live += 1
        elif fut.exception() is not None:
            logger.error("KV events rank %d: send failed: %r", self.dp_rank, fut.exception())

    async def wait_subscribers(self, count: int = 1) -> None:
        """Wait until ``count`` subscribe requests reached the PUB socket (for tests)."""
        while self.subscriptions_seen < count:
            self._sub_event.clear()
            await self._sub_event.wait()

    # ---- tasks
    async def _watch_subscriptions(self) -> None:
        assert self._pub is not None
        while True:
            msg = await self._pub.recv()
            if msg[:1] == b"\x01":
                self.subscriptions_seen += 1
                self._sub_event.set()

    async def _serve_replay(self) -> None:
        router = self._router
        assert router is not None
        while True:
            frames = await router.recv_multipart()
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                logger.warning(
                    "KV events rank %d: malformed replay request (%d frames)", self.dp_rank, len(frames)
                )
                continue
            ident, start = frames[0], int.from_bytes(frames[2], "big")
            held = self.sequencer.buffer.since(start + self.faults.replay_offset)
            # a subscriber's silence probe asks every few seconds while idle: say only what sends
            logger.log(
                logging.INFO if held else logging.DEBUG,
                "KV events rank %d: replay from %d: %d batches%s",
                self.dp_rank,
                start,
                len(held),
                f" (first {held[0][0]})" if held else "",
            )
            for seq, payload in held:
                await router.send_multipart(self._reply(ident, seq_bytes(seq), payload))
            await router.send_multipart(self._reply(ident, END_SEQ, b"", end=True))

    def _reply(self, ident: bytes, seq: bytes, payload: bytes, *, end: bool = False) -> list[bytes]:
        if self.style == "sglang":
            return [ident, b"", seq, payload]
        return [ident, b"", b"" if end else self._topic, seq, payload]

    # ---- discovery
    def source(self) -> pb.KvEventSource:
        replay = f"tcp://{_zmq_host(self.host)}:{self.replay_port}" if self.replay_port is not None else ""
        return pb.KvEventSource(
            transport="zmq",
            endpoint_addr=pb.KvEndpoint(host=self.host, port=self.port, protocol="tcp"),
            topic=self.topic,
            replay_endpoint=replay,
            data_parallel_rank=self.dp_rank,
            encoding="msgpack",
            buffer_steps=self.buffer_steps,
            hwm=self.hwm,
        )


class ZmqKvEvents:
    """Every DP rank's :class:`ZmqKvPublisher`; the engine's :class:`~sidecar.mock.kvcache.KvEventSink`.

    ``port`` 0 → ephemeral ports; ``replay_port`` ``None`` → ``port + 100`` (0 if
    ``port`` is 0); ``replay=False`` → no replay socket (empty ``replay_endpoint``).
    Use as ``async with``: binds all sockets on entry (``OSError``/``zmq.ZMQError``
    if a port is taken), serves replay in background tasks, closes everything on exit.
    """

    def __init__(
        self,
        ranks: Iterable[int] | int = 1,
        *,
        bind_host: str = "127.0.0.1",
        advertise_host: str | None = None,
        port: int = 5557,
        replay_port: int | None = None,
        replay: bool = True,
        topic: str = "",
        style: Style = "vllm",
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        faults: KvFaults | None = None,
    ) -> None:
        self.ranks = list(range(ranks)) if isinstance(ranks, int) else list(ranks)
        if replay and replay_port is None:
            replay_port = port + 100 if port else 0
        self._bind_host = bind_host
        self._advertise_host = advertise_host
        self._port = port
        self._replay_port = replay_port if replay else None
        self._topic = topic
        self._style: Style = style
        self._buffer_steps = buffer_steps
        self._hwm = hwm
        self._faults = faults
        self._ctx: zmq.asyncio.Context | None = None
        self.publishers: dict[int, ZmqKvPublisher] = {}
        self._service: asyncio.Task[None] | None = None

    async def __aenter__(self) -> ZmqKvEvents:
        self._ctx = zmq.asyncio.Context()
        try:
            for i, rank in enumerate(self.ranks):
                rport = self._replay_port
                pub = ZmqKvPublisher(
                    self._ctx,
                    rank,
                    bind_host=self._bind_host,
                    advertise_host=self._advertise_host,
                    port=self._port + i if self._port else 0,
                    replay_port=None if rport is None else (rport + i if rport else 0),
                    topic=self._topic,
                    style=self._style,
                    buffer_steps=self._buffer_steps,
                    hwm=self._hwm,
                    faults=self._faults,
                )
                self.publishers[rank] = pub
                pub.bind()
            # One service task owns the publishers' task group: a group cannot be opened here and
            # left in __aexit__, which may run in another asyncio task (trio-asyncio's wrappers).
            self._service = asyncio.create_task(self._serve(), name="kv-events")
        except BaseException:
            await self.aclose()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _serve(self) -> None:
        try:
            async with asyncio.TaskGroup() as group:
                for pub in self.publishers.values():
                    group.create_task(pub.run(), name=f"kv-events-{pub.dp_rank}")
        except Exception:
            logger.exception("KV event publishers failed: no more KV events are served")
            raise

    async def aclose(self) -> None:
        """Stop the publishers (their failure, if any, is raised here), close the sockets."""
        service, self._service = self._service, None
        try:
            if service is not None:
                service.cancel()
                try:
                    await service
                except asyncio.CancelledError:
                    if not service.cancelled():
                        raise  # this task's own cancellation
        finally:
            self._close_sockets()

    def _close_sockets(self) -> None:
        for pub in self.publishers.values():
            pub.close()
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def publish(self, dp_rank: int, events: Sequence[KvEventRecord]) -> int | None:
        pub = self.publishers.get(dp_rank)
        if pub is None:
            raise UnknownDpRank(f"no KV event publisher for DP rank {dp_rank}")
        return pub.publish(events)

    def sources(self, ranks: Sequence[int] = ()) -> pb.GetKvEventSourcesResponse:
        """``GetKvEventSources`` answer; empty ``ranks`` = all. Raises :class:`UnknownDpRank`."""
        wanted = list(ranks) or self.ranks
        unknown = [r for r in wanted if r not in self.publishers]
        if unknown:
            raise UnknownDpRank(f"unknown data-parallel rank(s) {unknown}")
        return pb.GetKvEventSourcesResponse(sources=[self.publishers[r].source() for r in wanted])


def kv_event_sources(
    events: ZmqKvEvents | GrpcKvEvents | None, ranks: Sequence[int] = ()
) -> pb.GetKvEventSourcesResponse:
    """``GetKvEventSources`` for whichever transport the engine runs (``None`` → no sources)."""
    if events is None:
        return pb.GetKvEventSourcesResponse()
    return events.sources(ranks)
