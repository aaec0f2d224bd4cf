"""Attacks on the HTTP (probe) listener measured like the client attacks of
:mod:`tests.reliability.attacks` (same :class:`~tests.reliability.attacks.Scenario`, bar and
:func:`~tests.reliability.attacks.run_scenario`; docs/SECURITY.md "HTTP listener"). The bar's
``/ready`` polls come from ``127.0.0.1`` (a kubelet), the flood from :data:`FLOODER`; probes
from the flooding address itself (a kubelet sharing a node address with a ``hostNetwork`` pod)
are counted in the notes. Used by ``tests/reliability/test_hostile_http.py`` and
``scripts/attack``.
"""

from __future__ import annotations

import os
import urllib.parse
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import trio

from tests.e2e.harness import Sidecar
from tests.reliability.attacks import ATTACKER, EMFILE, NOFILE, Attack, Scenario

#: Where the flood comes from.
FLOODER = "127.0.0.5"


async def timed_ready(http: str, source: str) -> float:
    """Seconds a ``GET /ready`` from ``source`` took (fails unless 200 within 5 s)."""
    transport = httpx.AsyncHTTPTransport(local_address=source)
    start = trio.current_time()
    async with httpx.AsyncClient(transport=transport) as client:
        assert (await client.get(http + "/ready", timeout=5)).status_code == 200
    return trio.current_time() - start


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def closed_by_server(stream: trio.SocketStream) -> bool:
    with trio.move_on_after(0.01):
        try:
            return not await stream.receive_some(1)
        except (trio.BrokenResourceError, OSError):
            return True
    return False


def idle_probe_connections(count: int, source: str = FLOODER) -> Attack:
    """``count`` TCP connections to the probe port from ``source`` that never send a byte,
    opened 64 at a time and held; meanwhile ``/ready`` probes, each on a new connection, from
    ``source`` itself (how many were answered 200, the slowest), then one from ``127.0.0.1``."""

    @asynccontextmanager
    async def attack(sc: Sidecar) -> AsyncIterator[dict[str, Any]]:
        url = urllib.parse.urlsplit(sc.http)
        notes: dict[str, Any] = {"tried": count, "connected": 0, "not connected": 0}
        fds_before = open_fds(sc.proc.pid)
        probes: list[float | None] = []  # seconds, None: failed
        flooding = True
        held: list[trio.SocketStream] = []
        slots = trio.CapacityLimiter(64)

        async def one() -> None:
            async with slots:
                with trio.move_on_after(3):
                    try:
                        held.append(await trio.open_tcp_stream(url.hostname, url.port, local_address=source))
                        notes["connected"] += 1
                        return
                    except OSError:
                        pass
                notes["not connected"] += 1

        async def probe_meanwhile() -> None:
            while flooding:
                try:
                    probes.append(await timed_ready(sc.http, source))
                except (httpx.HTTPError, AssertionError):
                    probes.append(None)

        async with trio.open_nursery() as prober:
            prober.start_soon(probe_meanwhile)
            async with trio.open_nursery() as nursery:
                for _ in range(count):
                    nursery.start_soon(one)
            notes["sidecar fds added"] = open_fds(sc.proc.pid) - fds_before
            flooding = False
        answered = [t for t in probes if t is not None]
        notes["probes from the flooding address answered"] = f"{len(answered)}/{len(probes)}"
        notes["probes answered share"] = round(len(answered) / max(1, len(probes)), 2)
        notes["slowest probe answered s"] = round(max(answered, default=0.0), 3)
        notes["/ready from 127.0.0.1 s"] = round(await timed_ready(sc.http, ATTACKER), 3)
        yield notes
        notes["still open"] = sum([not await closed_by_server(s) for s in held])
        for s in held:
            await trio.aclose_forcefully(s)

    return attack


SCENARIOS = {
    "probe-connections": Scenario(
        "11",
        "3,000 idle connections to the probe port from one address (fd limit 1,536)",
        idle_probe_connections(3000),
        nofile=NOFILE,
        hold=2,
        log_counts=(EMFILE,),
    ),
}
