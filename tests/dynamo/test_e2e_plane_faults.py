"""Faults of Dynamo's planes under load: etcd restarted (on its data, and empty), etcd
unreachable at startup, NATS restarted.

Real processes on loopback: etcd, nats-server, Dynamo's frontend, ``run --dynamo`` sidecars in
front of mock engines. Load runs through the frontend (Dynamo plane) and through the sidecar's
WebSocket plane at the same time; every client outcome is recorded, and the engines' counters
judge leaks. The figures each test prints (detection and recovery times) are the ones in
docs/RELIABILITY.md.
"""

from __future__ import annotations

import json
import re
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from sidecar.childproc import loopback_run_args
from sidecar.client.sidecar_client import SidecarError, open_sidecar
from tests.dynamo.e2e import MODEL, Frontend, dynamo_sidecar, frontend, tokenizer_dir
from tests.dynamo.planes import deployment, free_port
from tests.e2e.harness import mock_engine, spawn, wait_engine_idle
from tests.reliability.helpers import scrape

pytestmark = [pytest.mark.subprocess, pytest.mark.dynamo]

TOKENS = 30


@dataclass
class Outcomes:
    """Client-side fates of the load's requests."""

    completed: int = 0
    retryable: list[str] = field(default_factory=list)  # 5xx, connection refused or cut: retry elsewhere
    wrong: list[str] = field(default_factory=list)  # anything a client must not see

    _changed: trio.Event = field(default_factory=trio.Event)

    def done(self) -> None:
        self.completed += 1
        self._changed.set()
        self._changed = trio.Event()

    async def wait_completed(self, n: int, timeout: float = 30) -> None:
        with trio.move_on_after(timeout):
            while self.completed < n:
                await self._changed.wait()
        assert self.completed >= n, (
            f"{n} completions awaited: {self.summary()}; {self.retryable[:3]} {self.wrong[:3]}"
        )

    def summary(self) -> str:
        return f"{self.completed} completed, {len(self.retryable)} retryable, {len(self.wrong)} wrong"


async def frontend_request(fe_url: str, tag: str, out: Outcomes) -> None:
    """One streamed completion through the frontend; its fate goes to ``out``."""
    body = {
        "model": MODEL,
        "prompt": f"load {tag}",
        "max_tokens": TOKENS,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    n, finish = 0, ""
    try:
        async with httpx.AsyncClient(base_url=fe_url, timeout=30) as http:
            async with http.stream("POST", "/v1/completions", json=body) as resp:
                if resp.status_code >= 500 or resp.status_code == 404:
                    # 404: the model is not (yet) known to a new frontend; 5xx: no worker now
                    out.retryable.append(f"{tag}: HTTP {resp.status_code}")
                    return
                if resp.status_code != 200:
                    out.wrong.append(f"{tag}: HTTP {resp.status_code} {await resp.aread()!r}")
                    return
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        out.retryable.append(f"{tag}: error event {chunk['error']}")
                        return
                    for choice in chunk.get("choices") or []:
                        finish = choice.get("finish_reason") or finish
                    if chunk.get("usage"):
                        n = chunk["usage"]["completion_tokens"]
    except httpx.TransportError as err:
        out.retryable.append(f"{tag}: {type(err).__name__}")
        return
    if finish == "length" and n == TOKENS:
        out.done()
    elif not finish:
        out.retryable.append(f"{tag}: stream ended without a finish")
    else:
        out.wrong.append(f"{tag}: finish {finish!r} after {n} tokens")


async def ws_request(ws: str, tag: str, out: Outcomes) -> None:
    """One stream on the sidecar's WebSocket plane (independent of Dynamo's planes)."""
    request = {"model": MODEL, "prompt": f"ws {tag}", "stopping": {"maxTokens": TOKENS, "ignoreEos": True}}
    try:
        async with open_sidecar(ws) as client, client.generate(request) as stream:
            async for _ in stream:
                pass
            end = stream.end
    except SidecarError as err:
        out.wrong.append(f"{tag}: {err}")
        return
    if end is not None and end.outcome == "completed":
        out.done()
    else:
        out.wrong.append(f"{tag}: {end}")


async def keep_loading(
    fe: Frontend | None, ws: str, stop: trio.Event, dyn: Outcomes, wsout: Outcomes
) -> None:
    """Four request loops (two per plane) until ``stop``; each finishes its request in flight."""

    async def loop(i: int, through_frontend: bool) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            if through_frontend and fe is not None:
                await frontend_request(fe.url, f"{i}.{n}", dyn)
            else:
                await ws_request(ws, f"{i}.{n}", wsout)

    async with trio.open_nursery() as nursery:
        for i in range(4):
            nursery.start_soon(loop, i, i < 2)


def assert_no_leak(counters: dict[str, Any]) -> None:
    c = counters
    assert c["requests_leaked"] == 0 and c["orphans_expired"] == 0, c
    ended = (
        c["requests_completed"]
        + c["requests_failed"]
        + c["requests_cancelled_by_client"]
        + c["requests_aborted"]
        + c["requests_dropped"]
    )
    assert ended == c["requests_accepted"], c


@pytest.mark.parametrize("keep_data", [True, False], ids=["on-its-data", "empty"])
async def test_etcd_restarted_under_load(aio_loop: Any, tmp_path: Path, keep_data: bool) -> None:
    """etcd restarted under load. On its data, Dynamo's runtime reconnects and keeps its lease:
    nothing changes. Empty, the runtime loses its lease and shuts its endpoint down; the sidecar
    notices, is not ready while it rebuilds ("Dynamo runtime lost"), registers again with a new
    lease, and a frontend started on the new etcd serves through it. No WebSocket stream is
    lost, every frontend request completes or fails retryably, the engine leaks nothing."""
    tok = tokenizer_dir(tmp_path)
    with trio.fail_after(240):
        async with (
            deployment(tmp_path) as dep,
            mock_engine(
                tmp_path, "--flavor", "vllm", "--tokenizer-source", str(tok), "--token-delay-ms", "20"
            ) as engine,
            dynamo_sidecar(dep, engine.address) as sc,
        ):
            assert dep.etcd is not None
            dyn, wsout = Outcomes(), Outcomes()
            async with frontend(dep) as fe:
                await fe.wait_models(MODEL)
                stop = trio.Event()
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(keep_loading, fe, sc.ws, stop, dyn, wsout)
                    await dyn.wait_completed(4)
                    await wsout.wait_completed(4)
                    await dep.etcd.server.restart(keep_data=keep_data, down_for=1.0)
                    back = trio.current_time()
                    if keep_data:
                        before = dyn.completed
                        await dyn.wait_completed(before + 8)
                    else:
                        lost = await sc.proc.wait_for_line(re.compile("runtime shut down on its own"), 90)
                        detected = trio.current_time() - back
                        await sc.proc.wait_for_line(re.compile("Dynamo: registered again"), 60)
                        recovered = trio.current_time() - back
                        print(
                            f"etcd back empty: lost lease noticed after {detected:.1f}s, registered again after {recovered:.1f}s ({lost.string[-80:]})"
                        )
                    stop.set()
            # a frontend that knows only the (new) etcd finds this worker and is served by it
            async with frontend(dep) as fe2:
                await fe2.wait_models(MODEL)
                after = Outcomes()
                for i in range(3):
                    await frontend_request(fe2.url, f"after-{i}", after)
                assert after.completed == 3, after
            m = await scrape(sc.http)
            restarts = m.value("openengine_sidecar_dynamo_runtime_restarts_total")
            assert restarts == (0 if keep_data else 1), restarts
            assert m.value("openengine_sidecar_dynamo_routable") == 1
            assert m.value("openengine_sidecar_ready") == 1
            if not keep_data:
                assert any("not ready: Dynamo runtime lost" in line for line in sc.proc.lines)
            print(f"frontend load: {dyn.summary()}; WebSocket load: {wsout.summary()}")
            assert not dyn.wrong and not wsout.wrong, (dyn.wrong, wsout.wrong)
            assert not wsout.retryable and wsout.completed >= 4  # the WebSocket plane never noticed
            if keep_data:
                assert not dyn.retryable, dyn.retryable
            assert_no_leak(await wait_engine_idle(engine.address, timeout=40))


async def test_etcd_unreachable_at_startup_waits_with_progress_and_honours_signals(
    aio_loop: Any, tmp_path: Path
) -> None:
    """No etcd yet: the sidecar waits for it without entering Dynamo's runtime (whose own wait
    blocks the event loop), logs its progress, answers its probes meanwhile (``/ready`` 503
    naming etcd), stops at once on SIGTERM, and — started again — registers as soon as etcd
    appears."""
    tok = tokenizer_dir(tmp_path)
    with trio.fail_after(120):
        async with (
            deployment(tmp_path) as dep,
            mock_engine(tmp_path, "--flavor", "vllm", "--tokenizer-source", str(tok)) as engine,
        ):
            assert dep.etcd is not None
            await dep.etcd.server.stop()
            http = f"127.0.0.1:{free_port()}"
            argv = [
                *loopback_run_args(engine.address),
                "--http-listen",
                http,
                "--dynamo",
                *dep.sidecar_args(),
            ]
            async with spawn(argv, env=dep.env()) as proc:
                await proc.wait_for_line(re.compile(r"Dynamo: waiting for etcd .*connection refused"), 30)
                t0 = trio.current_time()
                proc.signal(signal.SIGTERM)
                assert await proc.wait(timeout=10) == 0
                stopped = trio.current_time() - t0
                assert stopped < 5, stopped
                assert any("SIGTERM while starting: stopping" in line for line in proc.lines)
                print(f"etcd unreachable at startup: SIGTERM stopped the sidecar in {stopped:.2f}s")
            async with (
                spawn(argv, env=dep.env()) as proc,
                httpx.AsyncClient(base_url=f"http://{http}") as probe,
            ):
                await proc.wait_for_line(re.compile(r"Dynamo: waiting for etcd .*connection refused"), 30)
                await proc.wait_for_line(re.compile(r"Dynamo: waiting for etcd .* [5-9]s so far"), 30)
                ready = await probe.get("/ready", timeout=5)
                assert ready.status_code == 503 and "waiting for etcd" in ready.text, ready.text
                await dep.etcd.server.start()
                await proc.wait_for_line(re.compile(r"Dynamo: etcd reachable after"), 30)
                await proc.wait_for_line(re.compile(r"Dynamo: serving"), 60)
                assert (await probe.get("/ready", timeout=5)).status_code == 200
                async with frontend(dep) as fe:
                    await fe.wait_models(MODEL)
                    out = Outcomes()
                    await frontend_request(fe.url, "first", out)
                    assert out.completed == 1, out


async def test_nats_restarted_under_load_on_the_nats_request_plane(aio_loop: Any, tmp_path: Path) -> None:
    """NATS (request and event plane) restarted under load: requests in flight complete or
    fail retryably, requests after it are served again, the WebSocket plane never notices, no
    runtime is rebuilt (the worker stays registered), the engine leaks nothing."""
    tok = tokenizer_dir(tmp_path)
    with trio.fail_after(240):
        async with (
            deployment(tmp_path, "nats", "nats") as dep,
            mock_engine(
                tmp_path, "--flavor", "vllm", "--tokenizer-source", str(tok), "--token-delay-ms", "20"
            ) as engine,
            dynamo_sidecar(dep, engine.address) as sc,
            frontend(dep) as fe,
        ):
            assert dep.nats is not None
            await fe.wait_models(MODEL)
            dyn, wsout = Outcomes(), Outcomes()
            stop = trio.Event()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(keep_loading, fe, sc.ws, stop, dyn, wsout)
                await dyn.wait_completed(4)
                await dep.nats.server.restart(down_for=1.0)
                back = trio.current_time()
                before = dyn.completed
                await dyn.wait_completed(before + 4, timeout=60)
                served_again = trio.current_time() - back
                stop.set()
            print(
                f"NATS request plane restarted: served again {served_again:.1f}s after NATS was back; "
                f"frontend load: {dyn.summary()}; WebSocket load: {wsout.summary()}"
            )
            assert not dyn.wrong and not wsout.wrong and not wsout.retryable, (dyn.wrong, wsout.wrong)
            m = await scrape(sc.http)
            assert m.value("openengine_sidecar_dynamo_runtime_restarts_total") == 0
            assert m.value("openengine_sidecar_dynamo_routable") == 1
            assert_no_leak(await wait_engine_idle(engine.address, timeout=40))
