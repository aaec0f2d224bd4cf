"""Wait until Dynamo's planes — etcd (discovery, leases) and NATS (when a plane uses it) —
accept connections, before Dynamo's runtime is built.

Why: ``DistributedRuntime(...)`` retries an unreachable etcd *inside one blocking call* (its
own backoff, for ever), which freezes the sidecar's event loop: no signal is handled, no
probe answered, nothing logged by us. So the plane first waits here, asynchronously — TCP
connections to the endpoints Dynamo's runtime will use (``ETCD_ENDPOINTS``, ``NATS_SERVER``,
with Dynamo's defaults), a progress line every :data:`PROGRESS_EVERY` seconds, bounded by a
deadline — and builds the runtime only once they answer. A short race remains (a server that
vanishes between the check and the runtime's own connect); Dynamo's retries cover it.

Errors: :class:`PlanesUnreachable` at the deadline (one line naming what did not answer).
"""

from __future__ import annotations

import logging
import os
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import trio

from sidecar.dynamo.config import DynamoConfig
from sidecar.nursery import first_leaf

log = logging.getLogger(__name__)

#: Seconds between two "still waiting" lines.
PROGRESS_EVERY = 5.0
#: Bound of one TCP connection attempt.
CONNECT_TIMEOUT = 1.0
#: Pause between two rounds of attempts.
RETRY_EVERY = 0.5

_DEFAULTS = {
    "etcd": ("ETCD_ENDPOINTS", "http://localhost:2379", 2379),
    "NATS": ("NATS_SERVER", "nats://localhost:4222", 4222),
}


class PlanesUnreachable(Exception):
    """A plane did not accept a connection before the deadline (``str``: one line)."""


@dataclass(frozen=True)
class PlaneServer:
    """One server Dynamo's runtime will connect to."""

    plane: str  # "etcd" or "NATS"
    url: str
    host: str
    port: int


def _parse(plane: str, url: str, default_port: int) -> PlaneServer | None:
    text = url.strip()
    if not text:
        return None
    parts = urllib.parse.urlsplit(text if "://" in text else f"//{text}")
    try:
        port = parts.port or default_port
    except ValueError:
        return None
    return PlaneServer(plane, text, parts.hostname or "localhost", port)


def plane_servers(
    config: DynamoConfig, environ: Mapping[str, str] | None = None
) -> dict[str, list[PlaneServer]]:
    """The servers per plane this configuration needs (any one of a plane's servers is enough):
    etcd for ``--dynamo-discovery-backend etcd``, NATS when the request or event plane is NATS."""
    env = os.environ if environ is None else environ
    needed = []
    if config.discovery_backend == "etcd":
        needed.append("etcd")
    if "nats" in (config.request_plane, config.event_plane):
        needed.append("NATS")
    out: dict[str, list[PlaneServer]] = {}
    for plane in needed:
        var, default, port = _DEFAULTS[plane]
        servers = [s for u in (env.get(var) or default).split(",") if (s := _parse(plane, u, port))]
        out[plane] = servers
    return out


async def _reachable(server: PlaneServer) -> str | None:
    """``None`` when ``server`` accepts a TCP connection, else why not."""
    with trio.move_on_after(CONNECT_TIMEOUT):
        try:
            stream = await trio.open_tcp_stream(server.host, server.port)
        except OSError as err:
            return _reason(err)
        await stream.aclose()
        return None
    return f"no answer in {CONNECT_TIMEOUT:g}s"


def _reason(err: BaseException) -> str:
    """The first concrete cause of a failed connection (trio wraps one error per address)."""
    cause: BaseException | None = err
    while cause is not None:
        if isinstance(cause, BaseExceptionGroup):
            cause = first_leaf(cause)
        elif isinstance(cause, OSError) and (cause.errno or cause.strerror):
            return (os.strerror(cause.errno) if cause.errno else str(cause.strerror)).lower()
        else:
            cause = cause.__cause__
    return str(err) or type(err).__name__


async def wait_for_planes(
    servers: dict[str, list[PlaneServer]],
    timeout: float,
    *,
    what: str = "",
    waiting: Callable[[str], None] | None = None,
) -> None:
    """Return once every plane has a server accepting connections; log progress while waiting
    (and call ``waiting(problem)`` at each progress line). Raises :class:`PlanesUnreachable`
    after ``timeout`` seconds. Cancellable at any point."""
    start = trio.current_time()
    next_progress = start
    pending = dict(servers)
    while True:
        problems = []
        for plane, candidates in list(pending.items()):
            reasons = []
            for server in candidates:
                reason = await _reachable(server)
                if reason is None:
                    del pending[plane]
                    break
                reasons.append(f"{server.url}: {reason}")
            else:
                problems.append(f"{plane} ({'; '.join(reasons) or 'no server configured'})")
        if not pending:
            if trio.current_time() > start + RETRY_EVERY:
                log.info("Dynamo: %s reachable after %.0fs", ", ".join(servers), trio.current_time() - start)
            return
        waited = trio.current_time() - start
        if waited >= timeout:
            raise PlanesUnreachable(f"{' and '.join(problems)} unreachable for {timeout:g}s")
        if trio.current_time() >= next_progress:
            if waiting is not None:
                waiting(f"waiting for {' and '.join(problems)}")
            log.warning(
                "Dynamo: waiting for %s%s; %.0fs so far, giving up after %gs",
                ", ".join(problems),
                f" ({what})" if what else "",
                waited,
                timeout,
            )
            next_progress += PROGRESS_EVERY
        await trio.sleep(min(RETRY_EVERY, max(0.0, start + timeout - trio.current_time())))
