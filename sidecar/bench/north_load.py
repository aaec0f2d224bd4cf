"""Load generators that drive the sidecar's north protocol (run inside a worker process).

Every function takes the worker spec (a dict) and returns a JSON-able result. The
client side is the lean :class:`~sidecar.bench.wsclient.WsClient`: one reader per
connection decodes each frame (msgspec, only the fields the benchmark needs) and updates
per-stream counters synchronously — no channel or task per event.
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Callable
from typing import Any

import msgspec
import trio

from sidecar.bench import stats
from sidecar.bench.wsclient import OP_BINARY, WsClient

# --- decoding only what the benchmark reads ---------------------------------------------------


class _Tok(msgspec.Struct):
    text: str = ""


class _Resp(msgspec.Struct):
    token: _Tok | None = None


class _Err(msgspec.Struct):
    code: str = ""
    message: str = ""


class _Msg(msgspec.Struct):
    type: str
    stream: int | str | None = None
    response: _Resp | None = None
    outcome: str | None = None
    error: _Err | None = None
    items: list[_Msg] | None = None
    message: str | None = None


_dec_mp = msgspec.msgpack.Decoder(_Msg)
_dec_js = msgspec.json.Decoder(_Msg)
_enc_mp = msgspec.msgpack.Encoder().encode
_enc_js = msgspec.json.Encoder().encode


def north_request(spec: dict[str, Any], max_tokens: int, **mock: Any) -> dict[str, Any]:
    """The proto3-JSON ``GenerateRequest`` the benchmark sends (``mock`` → ``extra.mock``)."""
    req: dict[str, Any] = {
        "model": spec["model"],
        "prompt": spec.get("prompt", "Hello"),
        "stopping": {"maxTokens": max_tokens, "ignoreEos": True},
    }
    if mock:
        req["extra"] = {"mock": mock}
    return req


class StreamState:
    """What the reader learns about one stream."""

    __slots__ = (
        "done",
        "end_ns",
        "error",
        "first_ns",
        "id",
        "outcome",
        "recv_ns",
        "sent_ns",
        "stamps",
        "tokens",
    )

    def __init__(self, sid: int, *, event: bool = False) -> None:
        self.id = sid
        self.tokens = 0
        self.outcome: str | None = None
        self.error = ""
        self.sent_ns = 0
        self.end_ns = 0
        self.first_ns = 0
        self.recv_ns: list[int] | None = None
        self.stamps: list[str] | None = None
        self.done = trio.Event() if event else None


class Tracker:
    """Counts ended streams and first tokens; wakes a waiter when a target is reached."""

    def __init__(self) -> None:
        self.ended = 0
        self.first_tokens = 0
        self._waiters: list[tuple[Callable[[], bool], trio.Event]] = []

    def poke(self) -> None:
        if self._waiters:
            for cond, ev in list(self._waiters):
                if cond():
                    ev.set()
                    self._waiters.remove((cond, ev))

    async def wait_for(self, cond: Callable[[], bool]) -> None:
        if cond():
            return
        ev = trio.Event()
        self._waiters.append((cond, ev))
        await ev.wait()


class NorthConn:
    """One connection: its streams, its reader callback, its frame builder."""

    def __init__(self, ws: WsClient, tracker: Tracker, *, encoding: str, record: bool = False) -> None:
        self.ws = ws
        self.tracker = tracker
        self.msgpack = encoding == "msgpack"
        self.record = record
        self.streams: dict[int | str, StreamState] = {}
        self.frames = 0
        self.coalesced = 0
        self.protocol_errors = 0

    @classmethod
    async def open(
        cls, url: str, tracker: Tracker, *, encoding: str, coalesce: bool, record: bool
    ) -> NorthConn:
        if coalesce:
            url += ("&" if "?" in url else "?") + "coalesce=1"
        return cls(await WsClient.connect(url), tracker, encoding=encoding, record=record)

    def encode(self, msg: dict[str, Any]) -> bytes | str:
        return _enc_mp(msg) if self.msgpack else _enc_js(msg).decode()

    async def generate(self, st: StreamState, request: dict[str, Any]) -> None:
        self.streams[st.id] = st
        frame = self.encode({"type": "generate", "stream": st.id, "request": request})
        st.sent_ns = time.time_ns()
        await self.ws.send(frame)

    async def cancel(self, sid: int) -> None:
        await self.ws.send(self.encode({"type": "cancel", "stream": sid}))

    def on_message(self, op: int, payload: bytes) -> None:
        self.frames += 1
        msg = _dec_mp.decode(payload) if op == OP_BINARY else _dec_js.decode(payload)
        self._handle(msg)

    def _handle(self, msg: _Msg) -> None:
        kind = msg.type
        if kind == "event":
            st = self.streams.get(msg.stream)  # type: ignore[arg-type]
            resp = msg.response
            if st is None or resp is None or resp.token is None:
                return
            st.tokens += 1
            if st.tokens == 1:
                st.first_ns = time.time_ns()
                self.tracker.first_tokens += 1
                self.tracker.poke()
            if self.record:
                assert st.recv_ns is not None and st.stamps is not None
                st.recv_ns.append(time.time_ns())
                st.stamps.append(resp.token.text)
        elif kind == "events":
            self.coalesced += 1
            for item in msg.items or ():
                self._handle(item)
        elif kind == "end":
            st = self.streams.pop(msg.stream, None)  # type: ignore[arg-type]
            if st is not None:
                error = msg.error.code if msg.error else ""
                if msg.outcome == "rejected" and msg.error:
                    error += f" ({msg.error.message[:80]})"
                self._finish(st, msg.outcome or "?", error)
        elif kind == "protocol_error":
            self.protocol_errors += 1

    def _finish(self, st: StreamState, outcome: str, error: str) -> None:
        st.outcome, st.error, st.end_ns = outcome, error, time.time_ns()
        if st.done is not None:
            st.done.set()
        self.tracker.ended += 1
        self.tracker.poke()

    async def run(self) -> None:
        """Read until the connection closes; streams still open then end as ``lost``."""
        await self.ws.run(self.on_message)
        for st in list(self.streams.values()):
            self._finish(st, "lost", f"connection closed ({self.ws.close_code})")
        self.streams.clear()


def _outcomes(states: list[StreamState]) -> dict[str, int]:
    out: dict[str, int] = {}
    for st in states:
        key = st.outcome or "none"
        if st.error and st.outcome != "completed":
            key += f":{st.error}"
        out[key] = out.get(key, 0) + 1
    return out


def _conn_figures(conns: list[NorthConn]) -> dict[str, int]:
    return {
        "frames": sum(c.frames for c in conns),
        "events_frames": sum(c.coalesced for c in conns),
        "protocol_errors": sum(c.protocol_errors for c in conns),
    }


class _Conns:
    """Open connections with their readers running in ``nursery``."""

    def __init__(self, spec: dict[str, Any], tracker: Tracker, *, record: bool = False) -> None:
        self.spec = spec
        self.tracker = tracker
        self.record = record
        self.list: list[NorthConn] = []

    async def open(self, nursery: trio.Nursery, n: int) -> list[NorthConn]:
        out = []
        for _ in range(n):
            conn = await NorthConn.open(
                self.spec["url"],
                self.tracker,
                encoding=self.spec.get("encoding", "msgpack"),
                coalesce=self.spec.get("coalesce", True),
                record=self.record,
            )
            nursery.start_soon(conn.run)
            out.append(conn)
        self.list.extend(out)
        return out

    async def close_all(self) -> None:
        for conn in self.list:
            await conn.ws.close()


async def warm_up(spec: dict[str, Any], streams: int = 8, tokens: int = 20) -> None:
    """A few short streams (connections, caches, the engine's pre-encoded tokens)."""
    tracker = Tracker()
    conns = _Conns(spec, tracker)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            (conn,) = await conns.open(nursery, 1)
            for i in range(streams):
                await conn.generate(StreamState(i), north_request(spec, tokens))
            await tracker.wait_for(lambda: tracker.ended >= streams)
            await conns.close_all()


# --- scenarios ------------------------------------------------------------------------------------


async def relay(spec: dict[str, Any], cpu: Callable[[], dict[str, float]]) -> dict[str, Any]:
    """N streams x M tokens, all at once, over C connections; tokens/s and CPU over the window."""
    n, m, nconn = spec["streams"], spec["tokens"], spec["connections"]
    await warm_up(spec)
    tracker = Tracker()
    conns = _Conns(spec, tracker)
    states = [StreamState(i) for i in range(n)]
    request = north_request(spec, m)
    async with trio.open_nursery() as nursery:
        opened = await conns.open(nursery, nconn)
        cpu0, t0 = cpu(), time.perf_counter()
        for st in states:
            await opened[st.id % nconn].generate(st, request)
        await tracker.wait_for(lambda: tracker.ended >= n)
        t1, cpu1 = time.perf_counter(), cpu()
        await conns.close_all()
    tokens = sum(st.tokens for st in states)
    return {
        "streams": n,
        "tokens_per_stream": m,
        "connections": nconn,
        "tokens": tokens,
        "seconds": t1 - t0,
        "tokens_per_s": tokens / (t1 - t0),
        "cpu_s": {k: cpu1[k] - cpu0[k] for k in cpu0},
        "outcomes": _outcomes(states),
        **_conn_figures(conns.list),
    }


async def short(spec: dict[str, Any], cpu: Callable[[], dict[str, float]]) -> dict[str, Any]:
    """``concurrency`` clients, each sending 1-token requests back to back for ``seconds``."""
    users, seconds, nconn = spec["concurrency"], spec["seconds"], spec["connections"]
    await warm_up(spec)
    tracker = Tracker()
    conns = _Conns(spec, tracker)
    request = north_request(spec, 1)
    ids = itertools.count()
    latencies: list[float] = []
    states: list[StreamState] = []
    async with trio.open_nursery() as nursery:
        opened = await conns.open(nursery, nconn)
        cpu0, t0 = cpu(), time.perf_counter()
        deadline = t0 + seconds

        async def user(conn: NorthConn) -> None:
            while time.perf_counter() < deadline:
                st = StreamState(next(ids), event=True)
                states.append(st)
                t = time.perf_counter()
                await conn.generate(st, request)
                assert st.done is not None
                await st.done.wait()
                latencies.append(time.perf_counter() - t)

        async with trio.open_nursery() as users_nursery:
            for u in range(users):
                users_nursery.start_soon(user, opened[u % nconn])
        t1, cpu1 = time.perf_counter(), cpu()
        await conns.close_all()
    done = sum(1 for st in states if st.outcome == "completed")
    return {
        "concurrency": users,
        "connections": nconn,
        "requests": len(states),
        "completed": done,
        "seconds": t1 - t0,
        "requests_per_s": done / (t1 - t0),
        "latency_ms": stats.summary(latencies, 1000),
        "cpu_s": {k: cpu1[k] - cpu0[k] for k in cpu0},
        "outcomes": _outcomes(states),
    }


def latency_figures(sent_ns: list[int], recv: list[list[int]], stamps: list[list[str]]) -> dict[str, Any]:
    """TTFT, inter-token gaps and engine→client one-way latency (ms) from per-stream records."""
    ttft: list[float] = []
    gaps: list[float] = []
    oneway: list[float] = []
    for sent, times, marks in zip(sent_ns, recv, stamps, strict=True):
        if not times:
            continue
        ttft.append((times[0] - sent) / 1e6)
        gaps.extend((b - a) / 1e6 for a, b in itertools.pairwise(times))
        for t, s in zip(times, marks, strict=True):
            if s.isdigit():
                oneway.append((t - int(s)) / 1e6)
    return {
        "ttft_ms": stats.summary(ttft),
        "itl_ms": stats.summary(gaps),
        "oneway_ms": stats.summary(oneway),
    }


async def latency(spec: dict[str, Any], cpu: Callable[[], dict[str, float]]) -> dict[str, Any]:
    """``streams`` paced streams (``token_delay_ms``), started at seeded random offsets within
    ``ramp_s``; every token's receive time and engine stamp are recorded."""
    n, m, nconn = spec["streams"], spec["tokens"], spec["connections"]
    await warm_up(spec)
    tracker = Tracker()
    conns = _Conns(spec, tracker, record=True)
    rng = random.Random(spec.get("seed", 1))
    offsets = sorted(rng.uniform(0, spec["ramp_s"]) for _ in range(n))
    request = north_request(spec, m, token_delay_ms=spec["token_delay_ms"], stamp=True)
    states = [StreamState(i) for i in range(n)]
    for st in states:
        st.recv_ns, st.stamps = [], []
    async with trio.open_nursery() as nursery:
        opened = await conns.open(nursery, nconn)
        cpu0, t0 = cpu(), trio.current_time()
        for st, off in zip(states, offsets, strict=True):
            await trio.sleep_until(t0 + off)
            await opened[st.id % nconn].generate(st, request)
        await tracker.wait_for(lambda: tracker.ended >= n)
        cpu1, t1 = cpu(), trio.current_time()
        await conns.close_all()
    out = latency_figures(
        [st.sent_ns for st in states],
        [st.recv_ns or [] for st in states],
        [st.stamps or [] for st in states],
    )
    out.update(
        streams=n,
        tokens=sum(st.tokens for st in states),
        seconds=t1 - t0,
        cpu_s={k: cpu1[k] - cpu0[k] for k in cpu0},
        outcomes=_outcomes(states),
    )
    return out


async def cancel_storm(spec: dict[str, Any], cpu: Callable[[], dict[str, float]]) -> dict[str, Any]:
    """Open ``streams`` paced streams (spread over ``ramp_s``) and wait until each has a token;
    then, within ``window_s``, cancel each at a seeded random point: half with ``cancel`` frames
    (shared connections), half by their connection going away (``disconnect_group`` streams per
    connection; alternately a closing handshake and a dropped TCP connection). Returns per-stream
    (request id, kind, cancel time in µs since the epoch) for the orchestrator to match with the
    engine's records."""
    n, group, nconn = spec["streams"], spec["disconnect_group"], spec["connections"]
    rng = random.Random(spec.get("seed", 2))
    nonce, m = spec["nonce"], spec["tokens"]
    await warm_up(spec)
    tracker = Tracker()
    conns = _Conns(spec, tracker)
    records: list[dict[str, Any]] = []
    ended: list[StreamState] = []
    n_cancel = n // 2
    n_groups = (n - n_cancel) // group
    total = n_cancel + n_groups * group

    def request(i: int) -> dict[str, Any]:
        req = north_request(spec, m, token_delay_ms=spec["token_delay_ms"])
        req["requestId"] = f"{nonce}-{i}"
        return req

    async with trio.open_nursery() as nursery:
        shared = await conns.open(nursery, nconn)
        groups = await conns.open(nursery, n_groups)
        states = {i: StreamState(i, event=True) for i in range(total)}
        t0 = trio.current_time()
        starts = sorted((rng.uniform(0, spec["ramp_s"]), i) for i in range(total))
        for at, i in starts:  # phase 1: open every stream
            await trio.sleep_until(t0 + at)
            conn = shared[i % nconn] if i < n_cancel else groups[(i - n_cancel) // group]
            await conn.generate(states[i], request(i))
        with trio.move_on_after(60):
            await tracker.wait_for(lambda: tracker.first_tokens + tracker.ended >= total)
        opened_s = trio.current_time() - t0
        storm = trio.current_time()
        cpu0 = cpu()

        async def cancelled(i: int, after: float) -> None:
            st = states[i]
            await trio.sleep_until(storm + after)
            if st.outcome is None:
                ns = time.time_ns()
                await shared[i % nconn].cancel(i)
                records.append({"request_id": f"{nonce}-{i}", "kind": "cancel", "cancel_us": ns // 1000})
            assert st.done is not None
            with trio.move_on_after(30):
                await st.done.wait()
            ended.append(st)

        async def disconnected(g: int, after: float) -> None:
            await trio.sleep_until(storm + after)
            conn = groups[g]
            ns = time.time_ns()
            kind = "close" if g % 2 == 0 else "drop"
            if kind == "close":
                await conn.ws.close(1000)
            else:
                await conn.ws.abort()
            for k in range(group):
                records.append(
                    {
                        "request_id": f"{nonce}-{n_cancel + g * group + k}",
                        "kind": kind,
                        "cancel_us": ns // 1000,
                    }
                )

        window = spec["window_s"]
        async with trio.open_nursery() as phase2:  # phase 2: the storm
            for i in range(n_cancel):
                phase2.start_soon(cancelled, i, rng.uniform(0, window))
            for g in range(n_groups):
                phase2.start_soon(disconnected, g, rng.uniform(0, window))
        cpu1 = cpu()
        await conns.close_all()
    return {
        "streams": total,
        "open_s": opened_s,
        "records": records,
        "cancel_frame_ends": _outcomes(ended),
        "cpu_s": {k: cpu1[k] - cpu0[k] for k in cpu0},
    }


async def idle(spec: dict[str, Any], armed: Callable[[dict[str, Any]], Any]) -> dict[str, Any]:
    """Open ``streams`` streams that each get one token and then stall (engine fault
    ``stall=1``); call ``armed`` once all have their token, then close every connection."""
    n, nconn = spec["streams"], spec["connections"]
    tracker = Tracker()
    conns = _Conns(spec, tracker)
    request = north_request(spec, 10, faults=["stall=1"])
    states = [StreamState(i) for i in range(n)]
    async with trio.open_nursery() as nursery:
        opened = await conns.open(nursery, nconn)
        t0 = time.perf_counter()
        for st in states:
            await opened[st.id % nconn].generate(st, request)
        await tracker.wait_for(lambda: tracker.first_tokens + tracker.ended >= n)
        opened_s = time.perf_counter() - t0
        await armed({"open_s": opened_s, "first_tokens": tracker.first_tokens, "ended": tracker.ended})
        await conns.close_all()
    return {"streams": n, "open_s": opened_s, "outcomes": _outcomes(states)}


async def drain(spec: dict[str, Any], armed: Callable[[dict[str, Any]], Any]) -> dict[str, Any]:
    """``streams`` long paced streams; ``armed`` once all have a token; then wait for every
    ``end`` (or the connection's close) and report when each came (ns since the epoch)."""
    n, nconn = spec["streams"], spec["connections"]
    tracker = Tracker()
    conns = _Conns(spec, tracker)
    request = north_request(spec, spec["tokens"], token_delay_ms=spec["token_delay_ms"])
    states = [StreamState(i) for i in range(n)]
    async with trio.open_nursery() as nursery:
        opened = await conns.open(nursery, nconn)
        for st in states:
            await opened[st.id % nconn].generate(st, request)
        await tracker.wait_for(lambda: tracker.first_tokens + tracker.ended >= n)
        await armed({"first_tokens": tracker.first_tokens})
        with trio.move_on_after(spec.get("timeout_s", 120)):
            await tracker.wait_for(lambda: tracker.ended >= n)
        ends = [st.end_ns for st in states if st.end_ns]
    return {
        "streams": n,
        "outcomes": _outcomes(states),
        "tokens": sum(st.tokens for st in states),
        "last_end_ns": max(ends) if ends else 0,
        "close_codes": sorted({c.ws.close_code or 0 for c in conns.list}),
    }
