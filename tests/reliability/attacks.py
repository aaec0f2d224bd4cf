"""Hostile clients against a real sidecar, and the bar each attack is measured against
(issue 15, docs/SECURITY.md).

Each attack is an async context manager ``attack(sc) -> notes``: on entry it puts its pressure
on the sidecar (and keeps it up), the body runs while it holds, on exit it lets go; ``notes``
(a dict) collects what the attacker saw. :func:`measure` runs one attack against a running
sidecar and returns a :class:`Verdict`: the sidecar's RSS before and at its peak, every
``/ready`` poll during the attack, and one ordinary ``generate`` of a second client — from
another peer address (``127.0.0.2``; the attacker uses ``127.0.0.1``) — timed while the attack
holds. The bar: RSS growth ≤ 64 MiB, ``/ready`` 200 throughout, the second client's generate
completed within 5 s.

:data:`SCENARIOS` names every attack of the issue with the sidecar it runs against;
:func:`run_scenario` runs one on a fresh simulated engine and sidecar. Used by
``tests/reliability/test_hostile_clients.py`` (assertions) and ``scripts/attack`` (the
before/after figures of docs/SECURITY.md).
"""

from __future__ import annotations

import json
import re
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import msgspec
import trio

from sidecar.childproc import SIDECAR_READY, loopback_run_args
from sidecar.north import codec, wire
from tests.e2e.harness import (
    Sidecar,
    eventually,
    generate_request,
    mock_engine,
    sidecar,
    spawn_argv,
    wait_engine_idle,
)
from tests.fuzz.mutate import OP_BINARY, OP_TEXT, Frame, ws_frame
from tests.fuzz.rawws import Closed, RawWs
from tests.north.test_codec_decode import deep_generate
from tests.reliability.helpers import rss_kib, scrape, stall_request

ATTACKER = "127.0.0.1"
SECOND = "127.0.0.2"
#: The bar of issue 15.
RSS_BAR_MIB = 64
SECOND_BAR_S = 5.0

Attack = Callable[[Sidecar], AbstractAsyncContextManager[dict[str, Any]]]


@dataclass
class Verdict:
    """What one attack did to the sidecar (see module doc)."""

    attack: str
    rss_before_kib: int = 0
    rss_peak_kib: int = 0
    ready_polls: int = 0
    ready_failures: int = 0
    second_outcome: str = "not run"
    second_seconds: float = 0.0
    notes: dict[str, Any] = field(default_factory=dict)

    @property
    def growth_mib(self) -> float:
        return (self.rss_peak_kib - self.rss_before_kib) / 1024

    @property
    def within_bar(self) -> bool:
        return (
            self.growth_mib <= RSS_BAR_MIB
            and self.ready_failures == 0
            and self.second_outcome == "completed"
            and self.second_seconds <= SECOND_BAR_S
        )

    def line(self) -> str:
        return (
            f"{self.attack}: RSS {self.rss_before_kib / 1024:.0f} -> {self.rss_peak_kib / 1024:.0f} MiB"
            f" (+{self.growth_mib:.0f}); /ready not 200 in {self.ready_failures}/{self.ready_polls} polls;"
            f" second client {self.second_outcome} in {self.second_seconds:.2f}s"
            f" [{'within' if self.within_bar else 'OUTSIDE'} the bar] {self.notes}"
        )


async def second_generate(ws_url: str, *, source: str = SECOND, timeout: float = 30) -> tuple[str, float]:
    """One ordinary 8-token ``generate`` on a new connection from ``source``: (outcome or what
    went wrong, seconds, the connection's handshake included)."""
    t0 = trio.current_time()
    with trio.move_on_after(timeout):
        try:
            ws = await RawWs.connect(ws_url, source=source)
        except (Closed, OSError) as err:
            return f"refused ({err})", trio.current_time() - t0
        try:
            outcome, _ = await generate_on(ws, 1, timeout=timeout)
        finally:
            await ws.aclose()
        return outcome, trio.current_time() - t0
    return f"no end within {timeout:g}s", trio.current_time() - t0


async def generate_on(ws: RawWs, stream: Any, *, timeout: float = 30) -> tuple[str, float]:
    """One ordinary 8-token ``generate`` on an open connection (nothing else may be running
    on it): (outcome or what went wrong, seconds)."""
    t0 = trio.current_time()
    outcome = f"no end within {timeout:g}s"
    with trio.move_on_after(timeout):
        try:
            request = generate_request(max_tokens=8)
            await ws.send_text(json.dumps({"type": "generate", "stream": stream, "request": request}))
            while True:
                msg = codec.decode_server_frame(await ws.next())
                if isinstance(msg, wire.End) and msg.stream == stream:
                    outcome = msg.outcome if msg.error is None else f"{msg.outcome} {msg.error.code}"
                    break
        except Closed as err:
            outcome = f"closed {err.code}"
    return outcome, trio.current_time() - t0


async def measure(
    name: str,
    sc: Sidecar,
    attack: Attack,
    *,
    hold: float = 3.0,
    second: Callable[[], Awaitable[tuple[str, float]]] | None = None,
) -> Verdict:
    """Run ``attack`` against ``sc`` (see module doc); the attack holds at least ``hold``
    seconds after its pressure is on (the RSS peak is sampled every 50 ms meanwhile).
    ``second``: the second client's generate (default: :func:`second_generate` on a new
    connection from ``127.0.0.2``)."""
    verdict = Verdict(name)
    pid = sc.proc.pid
    for _ in range(3):  # warm the paths: the baseline is a serving sidecar
        await second_generate(sc.ws)
    verdict.rss_before_kib = verdict.rss_peak_kib = rss_kib(pid)
    done = trio.Event()

    async def watch_rss() -> None:
        while not done.is_set():
            verdict.rss_peak_kib = max(verdict.rss_peak_kib, rss_kib(pid))
            with trio.move_on_after(0.05):
                await done.wait()

    async def watch_ready() -> None:
        async with httpx.AsyncClient() as http:
            while not done.is_set():
                try:
                    ok = (await http.get(sc.http + "/ready", timeout=2)).status_code == 200
                except httpx.HTTPError:
                    ok = False
                verdict.ready_polls += 1
                verdict.ready_failures += not ok
                with trio.move_on_after(0.1):
                    await done.wait()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch_rss)
        nursery.start_soon(watch_ready)
        async with attack(sc) as notes:
            held_until = trio.current_time() + hold
            run_second = second or partial(second_generate, sc.ws)
            verdict.second_outcome, verdict.second_seconds = await run_second()
            await trio.sleep_until(held_until)
            verdict.rss_peak_kib = max(verdict.rss_peak_kib, rss_kib(pid))
        done.set()
    verdict.notes = notes
    return verdict


# --- raw floods ---------------------------------------------------------------------------------


async def send_frames(ws: RawWs, frames: list[str], *, per_write: int = 1000) -> None:
    """Write JSON text frames, ``per_write`` to a socket write (blocks when the sidecar stops
    reading: that is TCP back-pressure)."""
    for i in range(0, len(frames), per_write):
        data = b"".join(ws_frame(OP_TEXT, f.encode()) for f in frames[i : i + per_write])
        await ws.stream.send_all(data)


async def read_all(ws: RawWs, into: list[Any]) -> None:
    """Decode everything the sidecar sends until it closes."""
    try:
        while True:
            into.append(codec.decode_server_frame(await ws.next()))
    except (Closed, trio.BrokenResourceError, trio.ClosedResourceError):
        pass


def results(messages: list[Any]) -> dict[str, int]:
    """``result`` answers by outcome (``ok`` or the error code), ``end``s by outcome and code."""
    out: dict[str, int] = {}
    for m in messages:
        if isinstance(m, wire.Result):
            key = "ok" if m.ok else (m.error.code if m.error else "error")
        elif isinstance(m, wire.End):
            key = f"end {m.outcome}" + (f" {m.error.code}" if m.error else "")
        else:
            key = type(m).__name__
        out[key] = out.get(key, 0) + 1
    return out


def call_flood(method: str, calls: int, *, read: bool, ramp: float = 3.0) -> Attack:
    """One connection sends ``calls`` ``call`` frames of ``method`` as fast as the sidecar takes
    them (for at most the attack's duration); ``read``: whether it reads the answers."""

    @asynccontextmanager
    async def attack(sc: Sidecar) -> AsyncIterator[dict[str, Any]]:
        notes: dict[str, Any] = {"calls": calls, "sent": 0}
        ws = await RawWs.connect(sc.ws, source=ATTACKER)
        received: list[Any] = []
        frames = [json.dumps({"type": "call", "call": i, "method": method}) for i in range(calls)]

        async def sender() -> None:
            for i in range(0, calls, 1000):
                await send_frames(ws, frames[i : i + 1000])
                notes["sent"] = min(calls, i + 1000)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(sender)
            if read:
                nursery.start_soon(read_all, ws, received)
            await trio.sleep(ramp)
            yield notes
            nursery.cancel_scope.cancel()
        notes["answers"] = results(received)
        await ws.stream.aclose()

    return attack


def huge_request_ids(streams: int = 8, size: int = 1 << 20) -> Attack:
    """``streams`` long generates with ``size``-character request ids on a connection that
    does not read (every event of a stream echoes its request id)."""

    @asynccontextmanager
    async def attack(sc: Sidecar) -> AsyncIterator[dict[str, Any]]:
        ws = await RawWs.connect(sc.ws, source=ATTACKER)
        frames = [
            json.dumps(
                {
                    "type": "generate",
                    "stream": i,
                    "request": generate_request(max_tokens=100_000, requestId=f"{i}-" + "x" * size),
                }
            )
            for i in range(streams)
        ]
        await send_frames(ws, frames, per_write=1)
        await trio.sleep(2.0)
        notes: dict[str, Any] = {"streams": streams, "id_chars": size}
        yield notes
        received: list[Any] = []
        with trio.move_on_after(3):
            await read_all(ws, received)
        notes["answers"] = results(received)
        await ws.stream.aclose()

    return attack


def idle_connections(count: int, sources: list[str], *, connect_timeout: float = 3.0) -> Attack:
    """``count`` connections (round-robin over ``sources``) that complete the handshake (or
    try to, for ``connect_timeout`` each) and then stay idle while the attack holds."""

    @asynccontextmanager
    async def attack(sc: Sidecar) -> AsyncIterator[dict[str, Any]]:
        notes: dict[str, Any] = {"tried": count, "open": 0, "refused 503": 0, "reset": 0, "hung": 0}
        held: list[RawWs] = []
        slots = trio.CapacityLimiter(64)

        async def one(i: int) -> None:
            async with slots:
                with trio.move_on_after(connect_timeout):
                    try:
                        held.append(await RawWs.connect(sc.ws, source=sources[i % len(sources)]))
                        notes["open"] += 1
                    except Closed as err:
                        notes[f"refused {err.code}"] = notes.get(f"refused {err.code}", 0) + 1
                    except OSError:
                        notes["reset"] += 1
                    return
                notes["hung"] += 1

        async with trio.open_nursery() as nursery:
            for i in range(count):
                nursery.start_soon(one, i)
        yield notes
        for ws in held:
            await trio.aclose_forcefully(ws.stream)

    return attack


async def first_event(ws: RawWs) -> wire.Event | wire.End:
    """The next ``event`` or ``end`` (other messages skipped)."""
    while True:
        msg = codec.decode_server_frame(await ws.next())
        if isinstance(msg, wire.Event | wire.End):
            return msg


@asynccontextmanager
async def digits_and_depth(sc: Sidecar) -> AsyncIterator[dict[str, Any]]:
    """A stream kept open (the engine stalls it), then on the same connection: 5,000-digit
    integer strings (JSON and msgpack) and 100,000-level nesting (JSON and msgpack); the answer
    to each is read, and at the end the stream is cancelled and its ``end`` read."""
    ws = await RawWs.connect(sc.ws, source=ATTACKER)
    await ws.send_text(json.dumps({"type": "generate", "stream": 1, "request": stall_request()}))
    first = await first_event(ws)
    assert isinstance(first, wire.Event), first
    big = "9" * 5000
    hostile: list[str | bytes] = [
        json.dumps({"type": "generate", "stream": 2, "request": {"sampling": {"seed": big}}}),
        msgspec.msgpack.encode(
            {"type": "generate", "stream": 3, "request": {"stopping": {"maxTokens": big}}}
        ),
        deep_generate("json", 100_000),
        deep_generate("msgpack", 100_000),
    ]
    notes: dict[str, Any] = {"answers": []}
    for frame in hostile:
        if isinstance(frame, str):
            await ws.send_text(frame)
        else:
            await ws.send(Frame(OP_BINARY, frame, "msgpack"))
        notes["answers"].append(codec.decode_server_frame(await ws.next()))
    yield notes
    await ws.send_text(json.dumps({"type": "cancel", "stream": 1}))
    notes["stream 1"] = await first_event(ws)
    await ws.aclose()


LOG_MARKER = "c0ffee15"
#: A request id that tries to forge a log line (a newline, a fake timestamp, a terminal escape).
FORGED_ID = f"{LOG_MARKER}\n2030-01-01 00:00:00,000 WARNING sidecar.core.sidecar: forged \x1b[2J" + "y" * 100


@asynccontextmanager
async def forged_log_line(sc: Sidecar) -> AsyncIterator[dict[str, Any]]:
    """A stream with :data:`FORGED_ID` that the engine breaks (an event after its terminal
    one): the sidecar logs the stream's request id."""
    ws = await RawWs.connect(sc.ws, source=ATTACKER)
    request = generate_request(
        max_tokens=50, requestId=FORGED_ID, extra={"mock": {"faults": ["token-after-finish"]}}
    )
    await ws.send_text(json.dumps({"type": "generate", "stream": 1, "request": request}))
    while not isinstance(end := codec.decode_server_frame(await ws.next()), wire.End):
        pass
    yield {"end": end}
    await ws.aclose()


def claimed_request_ids(claims: int = 20) -> Attack:
    """Client A opens a stream without a request id and reads the id the sidecar made; it
    claims the ids it guesses come next (the old ``sc-<prefix>-<n>`` counter; random ids of
    the same shape otherwise); then client B (another address) opens ``claims`` id-less
    streams. Notes: the first answer of each stream, ``active_streams`` while all are open."""

    @asynccontextmanager
    async def attack(sc: Sidecar) -> AsyncIterator[dict[str, Any]]:
        a = await RawWs.connect(sc.ws, source=ATTACKER)
        b = await RawWs.connect(sc.ws, source=SECOND)
        await a.send_text(json.dumps({"type": "generate", "stream": 0, "request": stall_request()}))
        seen = await first_event(a)
        assert isinstance(seen, wire.Event), seen
        observed = seen.response.request_id
        counter = re.fullmatch(r"(sc-\w+-)(\d+)", observed)
        guesses = (
            [f"{counter.group(1)}{int(counter.group(2)) + k}" for k in range(1, claims + 1)]
            if counter
            else [f"sc-{uuid.uuid4().hex}" for _ in range(claims)]
        )
        for i, rid in enumerate(guesses, 1):
            await a.send_text(
                json.dumps({"type": "generate", "stream": i, "request": stall_request(requestId=rid)})
            )
        a_first = [await first_event(a) for _ in guesses]
        for i in range(1, claims + 1):
            await b.send_text(json.dumps({"type": "generate", "stream": i, "request": stall_request()}))
        b_first = [await first_event(b) for _ in range(claims)]
        notes: dict[str, Any] = {
            "observed": observed,
            "a": results(a_first),
            "b": results(b_first),
            "active_streams": (await scrape(sc.http)).value("openengine_sidecar_active_streams"),
            "open": 1 + claims + sum(isinstance(m, wire.Event) for m in b_first),
        }
        yield notes
        for ws in (a, b):
            for i in range(claims + 1):
                await ws.send_text(json.dumps({"type": "cancel", "stream": i}))
        await a.aclose()
        await b.aclose()

    return attack


STALLED = re.compile(r"stalled for \d+s")


@asynccontextmanager
async def stalled_senders(sc: Sidecar) -> AsyncIterator[dict[str, Any]]:
    """A client that does not read opens 50 long streams and sends 3,000 ``describe`` calls,
    then waits for the sidecar's "stalled" log line (run it with a short ``--stall-timeout``)."""
    ws = await RawWs.connect(sc.ws, source=ATTACKER)
    frames = [
        json.dumps({"type": "generate", "stream": i, "request": generate_request(max_tokens=100_000)})
        for i in range(50)
    ] + [json.dumps({"type": "call", "call": i, "method": "describe"}) for i in range(3000)]
    with trio.move_on_after(5):  # the sidecar may stop reading us (back-pressure)
        await send_frames(ws, frames, per_write=100)
    await sc.proc.wait_for_line(STALLED, timeout=20)
    yield {}
    await trio.aclose_forcefully(ws.stream)


def all_streams(count: int) -> Attack:
    """One address opens ``count`` streams the engine keeps open (run the sidecar with
    ``--max-streams`` = ``count``); notes: the first answer of each."""

    @asynccontextmanager
    async def attack(sc: Sidecar) -> AsyncIterator[dict[str, Any]]:
        ws = await RawWs.connect(sc.ws, source=ATTACKER)
        for i in range(count):
            await ws.send_text(json.dumps({"type": "generate", "stream": i, "request": stall_request()}))
        first = [await first_event(ws) for _ in range(count)]
        yield {"attacker": results(first)}
        await trio.aclose_forcefully(ws.stream)

    return attack


# --- scenarios: an attack, the sidecar it runs against ------------------------------------------------

#: The simulated engine of every scenario: long generations allowed.
ENGINE = ("--flavor", "vllm", "--max-output-tokens", "1000000", "--max-context-length", "2000000")
#: The sidecar's file-descriptor limit in the connection scenarios (1,024 connections fit).
NOFILE = 1536


@dataclass(frozen=True)
class Scenario:
    """One attack of issue 15 with the sidecar it is run against (see :func:`run_scenario`)."""

    finding: str
    title: str
    attack: Attack
    sidecar_args: tuple[str, ...] = ()
    engine_args: tuple[str, ...] = ()
    #: The sidecar's RLIMIT_NOFILE (None: inherited).
    nofile: int | None = None
    hold: float = 3.0
    #: The second client connects before the attack (new connections may be refused by then).
    connected_second: bool = False
    #: What to count in the sidecar's log afterwards (added to the verdict's notes).
    log_counts: tuple[tuple[str, re.Pattern[str]], ...] = ()


TRACEBACKS = ("tracebacks", re.compile(r"Traceback"))
EMFILE = ("EMFILE lines", re.compile(r"Too many open files|EMFILE"))


SCENARIOS = {
    "request-ids": Scenario("1", "8 streams with 1 MiB request ids, not read", huge_request_ids(8, 1 << 20)),
    "calls": Scenario(
        "2", "245k describe calls, not read", call_flood("describe", 245_000, read=False), hold=8
    ),
    "lora": Scenario("3", "60k listLoras calls", call_flood("listLoras", 60_000, read=True, ramp=2), hold=8),
    "digits": Scenario("4", "5,000-digit integers, 100,000-level nesting", digits_and_depth),
    "log": Scenario(
        "5",
        "a request id forging a log line",
        forged_log_line,
        log_counts=(("forged lines", re.compile(r"^2030-01-01")),),
    ),
    "ids": Scenario("6", "claiming the request ids the sidecar makes", claimed_request_ids(20)),
    "stall": Scenario(
        "7",
        "a stalled client with 3,050 pending senders",
        stalled_senders,
        sidecar_args=("--stall-timeout", "2"),
        engine_args=("--token-delay-ms", "5"),  # the engine's CPU is not what is measured
        log_counts=(("stalled lines", STALLED), TRACEBACKS),
    ),
    "streams": Scenario(
        "11",
        "one address opens --max-streams (100) streams",
        all_streams(100),
        sidecar_args=("--max-streams", "100"),
        engine_args=("--max-running", "400", "--max-queue", "400"),
    ),
    "connections-peer": Scenario(
        "11",
        "1,600 idle connections from one address (fd limit 1,536)",
        idle_connections(1600, [ATTACKER]),
        nofile=NOFILE,
        hold=2,
        log_counts=(EMFILE,),
    ),
    "connections-total": Scenario(
        "11",
        "1,600 idle connections from four addresses (fd limit 1,536)",
        idle_connections(1600, [f"127.0.0.{i}" for i in range(3, 7)]),
        nofile=NOFILE,
        hold=2,
        connected_second=True,
        log_counts=(EMFILE,),
    ),
}


@dataclass
class Run:
    """What :func:`run_scenario` saw: the verdict, the sidecar's log, its metrics and the
    engine's counters once the attack let go."""

    verdict: Verdict
    lines: list[str]
    metrics: Any
    counters: dict[str, Any]


async def run_scenario(scenario: Scenario, tmp_path: Path, name: str = "") -> Run:
    """A fresh simulated engine and sidecar, the attack measured against them (:func:`measure`),
    then (the attack let go) the sidecar's connections closed and the engine idle. Needs a
    trio-asyncio loop."""
    async with mock_engine(tmp_path, *ENGINE, *scenario.engine_args) as engine:
        launch = (
            sidecar_with_fd_limit(engine.address, scenario.nofile, *scenario.sidecar_args)
            if scenario.nofile
            else sidecar(engine.address, *scenario.sidecar_args)
        )
        async with launch as sc:
            second = None
            connected = None
            if scenario.connected_second:
                connected = await RawWs.connect(sc.ws, source=SECOND)
                second = partial(generate_on, connected, 1)
            verdict = await measure(
                name or scenario.title, sc, scenario.attack, hold=scenario.hold, second=second
            )
            if connected is not None:
                await connected.aclose()

            async def settled() -> bool:
                return (await scrape(sc.http)).value("openengine_sidecar_connections") == 0

            await eventually(settled, timeout=30)
            counters = await wait_engine_idle(engine.address, timeout=30)
            lines = list(sc.proc.lines)
            for what, pattern in scenario.log_counts:
                verdict.notes[what] = sum(1 for line in lines if pattern.search(line))
            return Run(verdict, lines, await scrape(sc.http), counters)


# --- processes ----------------------------------------------------------------------------------


@asynccontextmanager
async def sidecar_with_fd_limit(engine_address: str, nofile: int, *args: str) -> AsyncIterator[Sidecar]:
    """``openengine-sidecar run`` (like ``tests.e2e.harness.sidecar``) with its file-descriptor
    limit (soft and hard ``RLIMIT_NOFILE``) set to ``nofile``."""
    boot = (
        "import os, resource, sys; "
        f"resource.setrlimit(resource.RLIMIT_NOFILE, ({nofile}, {nofile})); "
        "os.execv(sys.executable, [sys.executable, '-m', 'sidecar', *sys.argv[1:]])"
    )
    argv = [sys.executable, "-c", boot, *loopback_run_args(engine_address), *args]
    async with spawn_argv(argv, label="run") as proc:
        m = await proc.wait_for_line(SIDECAR_READY)
        yield Sidecar(proc, m.group(1), m.group(2))
