"""Attacks on the HTTP (probe) listener of a real ``openengine-sidecar run`` process
(issue 15, finding 10; docs/SECURITY.md "HTTP listener"). Each test reproduces the attack
at a size that ended the process or misbehaved before, and asserts the bounded outcome: the
process lives, ``/ready`` stays 200, a generate on the WebSocket completes within 5 s, RSS
grows by at most 64 MiB.

``pytest tests/reliability/test_hostile_http.py -s`` prints the measured figures.
"""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trustme
from trio_websocket import open_websocket_url

from tests.e2e.harness import Sidecar, mock_engine, sidecar
from tests.reliability import probe_attacks
from tests.reliability.attacks import run_scenario
from tests.reliability.helpers import rss_kib, scrape
from tests.reliability.test_security import TOKEN, _completes, tls_sidecar

pytestmark = [pytest.mark.subprocess, pytest.mark.hostile]

RSS_BOUND_KIB = 64 * 1024


async def _still_serving(sc: Sidecar, *, verify: Any = True, **ws: Any) -> None:
    """The bounded outcome every attack must leave: alive, ready, a generate within 5 s."""
    assert sc.proc.process.returncode is None, sc.proc.tail(40)
    async with httpx.AsyncClient(verify=verify) as client:
        assert (await client.get(sc.http + "/ready", timeout=5)).status_code == 200
    with trio.fail_after(5):
        await _completes(sc.ws, **ws)


async def test_http2_bodies_on_one_connection_do_not_end_the_process(tmp_path: Path) -> None:
    """Before: hypercorn's HTTP/2 code raised KeyError (a body arriving after its response)
    through the listener into the root nursery and the process exited, first round. Now HTTP/2
    is off on this port: those connections are refused, nothing else is touched."""
    with trio.fail_after(60):
        async with mock_engine(tmp_path, "--flavor", "vllm") as engine, sidecar(engine.address) as sc:
            rss0 = rss_kib(sc.proc.pid)
            refused = 0
            for _ in range(5):
                async with httpx.AsyncClient(http1=False, http2=True) as h2:

                    async def post(path: str, h2: httpx.AsyncClient = h2) -> None:
                        nonlocal refused
                        try:
                            await h2.post(sc.http + path, content=b"x" * 100_000, timeout=5)
                        except httpx.TransportError:
                            refused += 1

                    async with trio.open_nursery() as nursery:
                        for path in ("/ready", "/health", "/metrics", "/v1/worker", "/v1/load", "/x") * 3:
                            nursery.start_soon(post, path)
            await _still_serving(sc)
            growth = rss_kib(sc.proc.pid) - rss0
            print(f"\nHTTP/2 POST flood: {refused}/90 refused, RSS +{growth} KiB")
            assert refused == 90  # HTTP/2 is not served at all: no request got an answer
            assert growth <= RSS_BOUND_KIB
            assert "Traceback" not in "\n".join(sc.proc.lines)


async def test_forged_host_is_never_a_redirect_target(tmp_path: Path) -> None:
    with trio.fail_after(40):
        async with mock_engine(tmp_path, "--flavor", "vllm") as engine, sidecar(engine.address) as sc:
            async with httpx.AsyncClient() as client:
                for path in ("/metrics/", "/ready/", "/v1/worker/"):
                    r = await client.get(sc.http + path, headers={"host": "evil.example"}, timeout=5)
                    assert r.status_code == 404, (path, r.status_code, r.headers.get("location"))
                    assert "evil.example" not in r.headers.get("location", "")
            await _still_serving(sc)


async def test_bearer_scheme_in_any_case_on_both_listeners(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    with trio.fail_after(40):
        async with (
            mock_engine(tmp_path, "--flavor", "vllm") as engine,
            sidecar(engine.address, "--auth-token-file", str(token_file)) as sc,
        ):
            async with httpx.AsyncClient() as client:
                for scheme in ("bearer", "BEARER", "Bearer"):
                    headers = {"authorization": f"{scheme} {TOKEN}"}
                    r = await client.get(sc.http + "/metrics", headers=headers, timeout=5)
                    assert r.status_code == 200, scheme
                    async with open_websocket_url(
                        sc.ws, extra_headers=[(b"authorization", f"{scheme} {TOKEN}".encode())]
                    ):
                        pass
                r = await client.get(sc.http + "/metrics", headers={"authorization": f"bearer {TOKEN}x"})
                assert r.status_code == 401
            await _still_serving(sc, auth_token=TOKEN)


async def test_tls_handshake_timeout_equals_the_websocket_listeners(tmp_path: Path) -> None:
    """Before: a silent TCP client on the HTTPS port was held 60 s (the WSS port: 10 s)."""
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1")
    cert, key = tmp_path / "server.pem", tmp_path / "server.key"
    server.cert_chain_pems[0].write_to_path(str(cert))
    server.private_key_pem.write_to_path(str(key))
    trusted = ssl.create_default_context()
    ca.configure_trust(trusted)
    with trio.fail_after(60):
        async with (
            mock_engine(tmp_path, "--flavor", "vllm") as engine,
            tls_sidecar(engine.address, cert, key) as sc,
        ):
            held: dict[str, float] = {}

            async def silent(name: str, url: str) -> None:
                host, port = url.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)
                stream = await trio.open_tcp_stream(host, int(port))
                start = trio.current_time()
                async with stream:
                    with trio.fail_after(20):
                        try:
                            while await stream.receive_some(4096):
                                pass
                        except trio.BrokenResourceError:
                            pass
                held[name] = trio.current_time() - start

            async with trio.open_nursery() as nursery:
                nursery.start_soon(silent, "https", sc.http)
                nursery.start_soon(silent, "wss", sc.ws)
            print(f"\nhalf-open TLS held: {held}")
            assert abs(held["https"] - held["wss"]) < 2, held
            await _still_serving(sc, verify=trusted, ssl_context=trusted)
            metrics = await scrape(sc.http, verify=trusted)
            assert metrics.value("openengine_sidecar_http_failures_total") == 0


async def test_idle_connection_flood_keeps_probes_answered(aio_loop: Any, tmp_path: Path) -> None:
    """Issue 15 finding 11 on the probe port: hypercorn has no connection limit, and 3,000
    idle connections from one address took every file descriptor (``EMFILE``): probes and the
    engine's connections with them. Now the port holds at most ``--http-max-connections-per-peer``
    (16) of one address, each new connection closing the oldest idle one: ``/ready`` from
    elsewhere answers throughout (the bar), no ``EMFILE``, RSS bounded; and most probes from
    the flooding address itself are answered while the flood churns (one whose request has not
    arrived yet when 16 newer connections have can lose its place)."""
    with trio.fail_after(120):
        run = await run_scenario(probe_attacks.SCENARIOS["probe-connections"], tmp_path)
    print(run.verdict.line())
    notes = run.verdict.notes
    assert run.verdict.within_bar, run.verdict.line()
    assert notes["EMFILE lines"] == 0 and notes["still open"] <= 16, notes
    assert notes["sidecar fds added"] <= 16 + 64 + 8, notes  # per peer, refusals lingering, probes
    assert notes["/ready from 127.0.0.1 s"] < 1 and notes["slowest probe answered s"] < 2, notes
    assert notes["probes answered share"] >= 0.5, notes
    assert (
        run.metrics.value("openengine_sidecar_limit_refusals_total", limit="http_connections_per_peer") > 2000
    )
