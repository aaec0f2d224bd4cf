"""Unit tests of issue 19's benchmark parts: short/burst/fleet figures, their goals and tables,
the fleet client's HTTP/SSE handling (against a scripted loopback server) and the anchor's
request mapping (official bindings generated at run time)."""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio

from sidecar.bench import analysis, fleet, fleet_load, report


def _short(rps: float, completed: int, cpu: dict[str, float]) -> dict[str, Any]:
    return {
        "requests_per_s": rps,
        "completed": completed,
        "latency_ms": {"p50": 10.0, "p99": 20.0},
        "cpu_s": cpu,
    }


def test_short_figures_cpu_per_request_and_goals() -> None:
    runs = {
        "sidecar": [
            _short(900, 1000, {"self": 0.1, "sidecar": 0.6}),
            _short(800, 1000, {"self": 0.1, "sidecar": 0.8}),
        ],
        "engineclient": [_short(1000, 1000, {"self": 0.5}), _short(1000, 1000, {"self": 0.5})],
        "grpcio": [_short(1500, 1000, {"self": 0.4}), _short(1500, 1000, {"self": 0.6})],
    }
    fig = analysis.short_figures(runs)
    assert fig["sidecar"]["requests_per_s"] == pytest.approx(850)
    assert fig["sidecar"]["cpu_us_per_request"] == pytest.approx(700)  # the sidecar process, not the client
    assert fig["grpcio"]["cpu_us_per_request"] == pytest.approx(500)
    assert fig["ratio_vs_engineclient"] == pytest.approx(0.85)
    assert fig["cpu_per_request_vs_grpcio"] == pytest.approx(1.4)
    goals = {g["goal"]: g for g in analysis.goals({"short": {**fig, "config": {"concurrency": 64}}})}
    assert goals["short requests vs direct EngineClient"]["met"] is True
    assert goals["sidecar CPU/short request vs grpcio"]["met"] is False  # 1.4x > 1.3x
    assert goals["short requests/s"]["met"] is False


def _burst(ttfts: list[float], ended: int, sidecar_cpu: float | None = None) -> dict[str, Any]:
    cpu = {"self": 0.01} | ({"sidecar": sidecar_cpu} if sidecar_cpu is not None else {})
    return {"ttft_ms": ttfts, "ended": ended, "cpu_s": cpu}


def test_burst_figures_pool_every_burst_and_subtract_the_reference() -> None:
    runs = {
        "json": [_burst([20.0, 30.0], 2, 0.002), _burst([40.0, 44.0], 2, 0.002)],
        "lean": [_burst([10.0, 12.0], 2, 0.001), _burst([14.0, 16.0], 2, 0.001)],
        "grpcio": [_burst([5.0, 6.0], 2), _burst([7.0, 8.0], 2)],
        "engineclient": [_burst([6.0, 6.0], 2), _burst([6.0, 6.0], 1)],
    }
    fig = analysis.burst_figures(runs, expected=4)
    assert fig["reference"] == "grpcio"
    js = fig["clients"]["json"]
    assert js["ttft_ms"]["count"] == 4 and js["ttft_ms"]["p50"] == pytest.approx(35)
    assert js["added_ttft_ms"]["p50"] == pytest.approx(35 - 6.5)
    assert js["sidecar_cpu_us_per_request"] == pytest.approx(1000)
    assert "added_ttft_ms" not in fig["clients"]["engineclient"]  # a direct client adds nothing
    assert fig["clients"]["engineclient"]["completed"] == 3
    goals = {g["goal"]: g for g in analysis.goals({"burst": {"sizes": {"64": fig}}})}
    assert goals["burst of 64 (JSON client): added TTFT p50"]["met"] is False
    assert goals["burst of 64 (JSON client): added TTFT p99"]["met"] is True
    # without grpcio (no bindings), EngineClient is the reference
    del runs["grpcio"]
    assert analysis.burst_figures(runs, expected=4)["reference"] == "engineclient"
    table = report.render_table({"burst": {"sizes": {"64": fig}}})
    assert "grpcio (reference)" in table and "+28.50" in table


def _fleet(
    tps: float, ttft50: float, worker_cpu: float, tokens: int = 6400, done: int = 100
) -> dict[str, Any]:
    return {
        "tokens_per_s": tps,
        "requests_per_s": tps / 64,
        "ttft_ms": {"p50": ttft50, "p90": ttft50 * 2},
        "cpu_s": {"worker": worker_cpu, "frontend": 0.1, "engine": 0.05, "self": 0.01},
        "out_tokens": tokens,
        "completed": done,
        "errors": 0,
    }


def test_fleet_figures_ratios_goals_and_table() -> None:
    rounds = {
        "sidecar": [_fleet(9000, 20.0, 0.64), _fleet(9500, 22.0, 0.70), _fleet(9200, 21.0, 0.66)],
        "anchor": [_fleet(10_000, 18.0, 0.64), _fleet(10_000, 18.0, 0.64), _fleet(10_000, 18.0, 0.64)],
        "mocker": [_fleet(15_000, 10.0, 0.1)],
    }
    fig = fleet.fleet_figures(rounds)
    assert fig["sidecar"]["worker_cpu_us_per_token"] == pytest.approx(0.66 / 6400 * 1e6)
    assert fig["sidecar"]["worker_cpu_us_per_request"] == pytest.approx(6600)
    r = fig["ratios"]
    assert r["tokens_per_s_vs_anchor"] == pytest.approx(0.92)
    assert r["ttft_p50_minus_anchor_ms"] == pytest.approx(3.0)
    assert r["worker_cpu_per_token_vs_anchor"] == pytest.approx(0.66 / 0.64)
    goals = {g["goal"]: g for g in analysis.goals({"dynamo": fig})}
    assert goals["Dynamo: output tok/s vs anchor worker"]["met"] is False  # 0.92x < 1.2x
    assert goals["Dynamo: TTFT p50 minus anchor's"]["met"] is True
    assert goals["Dynamo: worker CPU/token vs anchor"]["met"] is True
    fig["config"] = {"requests": 256, "tokens": 64, "concurrency": 16}
    table = report.render_table({"dynamo": fig})
    assert "dynamo.mocker (ceiling)" in table and "0.92x" in table and "+3.0 ms" in table
    skipped = report.render_table({"dynamo": {"skipped": "dynamo.llm is not installed"}})
    assert "dynamo: skipped (dynamo.llm is not installed)" in skipped
    assert analysis.goals({"dynamo": {"skipped": "x"}}) == []


def test_paced_rounds_offer_both_workers_a_share_of_the_slower_rate_and_are_reported() -> None:
    """The paced (open-loop) rounds run at PACED_SHARE of the slower worker's closed-loop
    requests/s; their TTFT gap is its own goal row and its own table rows."""
    rounds = {
        "sidecar": [{**_fleet(9000, 20.0, 0.6), "requests_per_s": 150.0}],
        "anchor": [{**_fleet(5000, 18.0, 0.6), "requests_per_s": 80.0}],
        "mocker": [{**_fleet(20000, 10.0, 0.1), "requests_per_s": 300.0}],
    }
    assert fleet._paced_rate(rounds) == pytest.approx(fleet.PACED_SHARE * 80.0)
    assert fleet._paced_rate({"sidecar": rounds["sidecar"], "anchor": []}) is None
    assert fleet._paced_rate({"sidecar": rounds["sidecar"]}) is None  # no anchor (grpcio-tools missing)
    paced = fleet.fleet_figures({"sidecar": [_fleet(4000, 12.0, 0.3)], "anchor": [_fleet(4000, 10.0, 0.4)]})
    paced["rate"] = 64.0
    fig = fleet.fleet_figures(rounds)
    fig["paced"] = paced
    goals = {g["goal"]: g for g in analysis.goals({"dynamo": fig})}
    row = goals["Dynamo at equal request rate: TTFT p50 minus anchor's"]
    assert row["value"] == pytest.approx(2.0) and row["met"] is False  # later than the anchor
    fig["config"] = {"requests": 256, "tokens": 64, "concurrency": 16}
    table = report.render_table({"dynamo": fig})
    assert "at an equal 64.0 req/s (open loop): TTFT p50 ms" in table and "+2.0 ms" in table


# --- the fleet client against a scripted HTTP server ---------------------------------------------


@asynccontextmanager
async def http_server(respond: Callable[[bytes], list[bytes]]) -> AsyncIterator[str]:
    """A loopback server answering each connection with ``respond(request bytes)``, then closing."""

    async def handle(stream: trio.SocketStream) -> None:
        data = b""
        async with stream:
            while b"\r\n\r\n" not in data:
                data += await stream.receive_some(65536)
            head, _, body = data.partition(b"\r\n\r\n")
            length = next(
                (
                    int(ln.split(b":")[1])
                    for ln in head.split(b"\r\n")
                    if ln.lower().startswith(b"content-length")
                ),
                0,
            )
            while len(body) < length:
                body += await stream.receive_some(65536)
            for part in respond(head + b"\r\n\r\n" + body):
                await stream.send_all(part)

    async with trio.open_nursery() as nursery:
        (listener,) = await nursery.start(partial(trio.serve_tcp, handle, 0, host="127.0.0.1"))
        port = listener.socket.getsockname()[1]
        yield f"http://127.0.0.1:{port}"
        nursery.cancel_scope.cancel()


def _chunked(*payloads: bytes) -> list[bytes]:
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    return [head, *(b"%x\r\n%s\r\n" % (len(p), p) for p in payloads), b"0\r\n\r\n"]


async def test_fleet_client_reads_a_streamed_completion() -> None:
    seen: list[dict[str, Any]] = []

    def respond(request: bytes) -> list[bytes]:
        seen.append(json.loads(request.partition(b"\r\n\r\n")[2]))
        first = b'data: {"choices":[{"text":"a"}],"usage":null}\n\n'
        # an SSE line split across two chunks, then the usage chunk and [DONE]
        last = b'data: {"choices":[],"usage":{"completion_tokens":7}}\n\ndata: [DONE]\n\n'
        return _chunked(b'data: {"choices":[]}\n\n', first, last[:20], last[20:])

    with trio.fail_after(10):
        async with http_server(respond) as url:
            ttft, tokens = await fleet_load.stream_completion(url, fleet_load.completion_body("m", 7, 3))
            res = await fleet_load.run_load(url, "m", requests=5, concurrency=2, tokens=7)
    assert ttft > 0 and tokens == 7
    assert seen[0]["model"] == "m" and seen[0]["max_tokens"] == 7 and seen[0]["stream"] is True
    assert seen[0]["stream_options"] == {"include_usage": True}
    assert res["completed"] == 5 and res["out_tokens"] == 35 and res["errors"] == 0
    assert res["ttft_ms"]["count"] == 5


async def test_fleet_client_open_loop_starts_requests_on_its_schedule() -> None:
    """With a rate, request i starts at i / rate seconds whether or not the ones before it
    ended (an open loop): 6 requests at 50/s, each held 0.5 s by the server, are all in flight
    at once, and the run takes about 0.1 + 0.5 s, not 6 x 0.5 s."""
    started: list[float] = []
    release = trio.Event()
    in_flight = 0
    peak = 0

    async def handle(stream: trio.SocketStream) -> None:
        nonlocal in_flight, peak
        async with stream:
            data = b""
            while b"\r\n\r\n" not in data:
                data += await stream.receive_some(65536)
            started.append(trio.current_time())
            in_flight += 1
            peak = max(peak, in_flight)
            if peak == 6:
                release.set()
            with trio.move_on_after(5):
                await release.wait()
            in_flight -= 1
            for part in _chunked(b'data: {"choices":[{"text":"a"}],"usage":{"completion_tokens":1}}\n\n'):
                await stream.send_all(part)

    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            (listener,) = await nursery.start(partial(trio.serve_tcp, handle, 0, host="127.0.0.1"))
            url = f"http://127.0.0.1:{listener.socket.getsockname()[1]}"
            res = await fleet_load.run_load(url, "m", requests=6, concurrency=1, tokens=1, rate=50.0)
            nursery.cancel_scope.cancel()
    assert res["completed"] == 6 and res["errors"] == 0 and res["rate"] == 50.0
    assert peak == 6  # concurrency 1 would have kept one in flight: the loop did not wait
    assert started == sorted(started) and started[-1] - started[0] >= 5 / 50 * 0.9


async def test_fleet_client_counts_failed_requests() -> None:
    def respond(request: bytes) -> list[bytes]:
        return [b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 4\r\n\r\nbusy"]

    with trio.fail_after(10):
        async with http_server(respond) as url:
            with pytest.raises(fleet_load.FleetError, match="HTTP 503"):
                await fleet_load.stream_completion(url, b"{}")
            res = await fleet_load.run_load(url, "m", requests=3, concurrency=3, tokens=1)
            status, body = await fleet_load.get_json(url, "/v1/models")
    assert res["completed"] == 0 and res["errors"] == 3 and "HTTP 503" in res["error_samples"][0]
    assert math.isnan(res["ttft_ms"]["p50"])
    assert status == 503 and body is None


def test_missing_dynamo_names_the_installer(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    # every module of the extra found (installed here or not) except Dynamo's frontend
    found = importlib.util.find_spec("sidecar")
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "dynamo.frontend" else found
    )
    reason = fleet.missing_dynamo()
    assert reason is not None and "dynamo.frontend" in reason and "scripts/install-dynamo" in reason


# --- the anchor worker's request mapping ---------------------------------------------------------


def test_anchor_maps_a_dynamo_request_like_a_lean_worker(tmp_path: Path) -> None:
    from sidecar.bench.dynamo_anchor import Anchor
    from sidecar.bench.pb2 import generate_pb2, import_pb2

    gen, _ = import_pb2(generate_pb2(tmp_path / "pb2"))
    import importlib

    life = importlib.import_module("openengine.v1.lifecycle_pb2")
    anchor = Anchor((None, None), gen, life, "engine-model")
    req = anchor.request(
        {
            "token_ids": [5, 6, 7],
            "stop_conditions": {"max_tokens": 9, "ignore_eos": True, "stop_token_ids_hidden": [2, 11]},
            "sampling_options": {"temperature": 0.5, "top_k": 0, "seed": -1},
            "eos_token_ids": [2],
        },
        "rid-1",
    )
    assert req.request_id == "rid-1" and req.model == "engine-model"
    assert list(req.token_ids.ids) == [5, 6, 7]
    assert req.stopping.max_tokens == 9 and req.stopping.ignore_eos is True
    assert [c.stop_token_id for c in req.stopping.conditions] == [11]  # EOS stays the engine's rule
    assert req.sampling.temperature == 0.5 and not req.sampling.HasField("top_k")
    assert req.sampling.seed == 2**64 - 1
