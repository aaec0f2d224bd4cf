"""``openengine-sidecar run`` end to end: real mock-engine and sidecar processes, real sockets."""

from __future__ import annotations

import json
import random
import re
import signal
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import trio
from trio_websocket import ConnectionClosed, open_websocket_url

from sidecar.client.sidecar_client import SidecarConnectionError, open_sidecar
from sidecar.openengine import pb
from sidecar.openengine.client import open_engine_client
from tests.e2e.harness import (
    counters_once_aborted,
    engine_counters,
    eventually,
    generate_request,
    mock_engine,
    sidecar,
    wait_engine_idle,
)
from tests.reliability.helpers import scrape


async def http_get(url: str) -> httpx.Response:
    async with httpx.AsyncClient() as client:
        return await client.get(url, timeout=5)


async def ready_status(sc: Any, status: int) -> bool:
    return (await http_get(sc.http + "/ready")).status_code == status


async def run_one(sc_url: str, request: dict[str, Any], metadata: dict[str, str] | None = None) -> Any:
    async with open_sidecar(sc_url) as sc, sc.generate(request, metadata) as stream:
        events = [ev async for ev in stream]
    return events, stream.end


async def test_serves_streams_card_and_probes(aio_loop: Any, tmp_path: Path) -> None:
    with trio.fail_after(60):
        async with mock_engine(tmp_path, "--flavor", "vllm") as engine, sidecar(engine.address) as sc:
            events, end = await run_one(sc.ws, generate_request(max_tokens=5))
            assert end.outcome == "completed" and end.error is None
            tokens = [e for e in events if e.response.token is not None]
            assert len(tokens) == 5
            assert (
                events[-1].response.finished is not None and events[-1].response.usage.completion_tokens == 5
            )
            async with open_sidecar(sc.ws, encoding="msgpack") as client:
                card = await client.call("describe")
                health = await client.call("health")
            assert card["engine"]["name"] == "vllm" and card["role"] == "aggregated"
            assert health["ready"] is True
            assert (await http_get(sc.http + "/ready")).status_code == 200
            worker = (await http_get(sc.http + "/v1/worker")).json()
            assert worker["models"][0]["servedModelName"] == "Qwen/Qwen3-0.6B"
            metrics = (await http_get(sc.http + "/metrics")).text
            assert 'openengine_sidecar_streams_total{code="",outcome="completed"} 1.0' in metrics
            assert "openengine_sidecar_tokens_relayed_total 5.0" in metrics
            assert "openengine_sidecar_engine_generate_channels 1.0" in metrics  # the one client's pool
            assert (await http_get(sc.http + "/v1/load")).status_code == 200


REJECTIONS = [
    (generate_request(model="no-such-model"), None, "ERROR_CODE_MODEL_NOT_FOUND"),
    (generate_request(sampling={"numSequences": 99}), None, "ERROR_CODE_UNSUPPORTED_FEATURE"),
    (generate_request(), {"openengine-target-dp-rank": "x"}, "ERROR_CODE_INVALID_ARGUMENT"),
    (generate_request(), {"openengine-target-dp-rank": "7"}, "ERROR_CODE_INVALID_ARGUMENT"),
    (generate_request(), {"openengine-bogus": "1"}, "ERROR_CODE_INVALID_ARGUMENT"),
    (
        generate_request(kv={"session": {"sessionId": "s", "handoffProfile": "x"}}),
        None,
        "ERROR_CODE_ROLE_MISMATCH",
    ),
    (
        generate_request(media=[{"modality": "MODALITY_VIDEO", "url": "http://x/v.mp4"}]),
        None,
        "ERROR_CODE_UNSUPPORTED_FEATURE",
    ),
    (generate_request(loraName="nope"), None, "ERROR_CODE_MODEL_NOT_FOUND"),
]


async def test_admission_rejections_never_reach_the_engine(aio_loop: Any, tmp_path: Path) -> None:
    with trio.fail_after(60):
        async with mock_engine(tmp_path, "--flavor", "vllm") as engine, sidecar(engine.address) as sc:
            for request, metadata, code in REJECTIONS:
                events, end = await run_one(sc.ws, request, metadata)
                assert events == []
                assert end.outcome == "rejected", (request, end)
                assert end.error.code == code, (request, end.error)
            counters = await engine_counters(engine.address)
            assert counters["requests_accepted"] == 0
            assert counters["requests_rejected"] == 0


async def test_duplicate_stream_and_request_ids(aio_loop: Any, tmp_path: Path) -> None:
    """A ``generate`` reusing an open stream id -- valid or not, JSON or msgpack -- gets a
    ``protocol_error`` naming the id and nothing else: the open stream goes on and gets the one
    ``end`` of that id (reused call ids: tests/north/test_ws_ids.py). A duplicate ``requestId`` on
    a new stream is that stream's ``end rejected``."""
    with trio.fail_after(60):
        async with (
            mock_engine(tmp_path, "--flavor", "vllm", "--token-delay-ms", "50") as engine,
            sidecar(engine.address) as sc,
            open_websocket_url(sc.ws) as ws,
        ):
            first = {
                "type": "generate",
                "stream": 1,
                "request": generate_request(max_tokens=3, requestId="dup"),
            }
            await ws.send_message(json.dumps(first))
            await ws.send_message(json.dumps({**first, "request": generate_request(requestId="other")}))
            await ws.send_message(json.dumps({**first, "request": {"prompt": 1}}))  # invalid, same id
            await ws.send_message(msgspec.msgpack.encode({**first, "request": generate_request()}))
            await ws.send_message(json.dumps({**first, "stream": 2}))  # same requestId, new stream
            ends: dict[int, list[dict[str, Any]]] = {}
            refused: list[dict[str, Any]] = []
            while len(ends.get(1, [])) < 1 or len(ends.get(2, [])) < 1:
                raw = await ws.get_message()
                msg = json.loads(raw) if isinstance(raw, str) else msgspec.msgpack.decode(raw)
                if msg["type"] == "end":
                    ends.setdefault(msg["stream"], []).append(msg)
                elif msg["type"] == "protocol_error":
                    refused.append(msg)
            assert ends[2][0]["outcome"] == "rejected"
            assert ends[2][0]["error"]["code"] == "ERROR_CODE_DUPLICATE_REQUEST"
            assert [e["outcome"] for e in ends[1]] == ["completed"]
            assert [m.get("stream") for m in refused] == [1, 1, 1]
            assert all("already open" in m["message"] for m in refused)
            # the id is free again once its end arrived: reusing it now starts a new stream
            await ws.send_message(json.dumps({**first, "request": generate_request(max_tokens=1)}))
            while (msg := json.loads(await ws.get_message()))["type"] != "end":
                assert msg["type"] == "event" and msg["stream"] == 1
            assert (msg["stream"], msg["outcome"]) == (1, "completed")
            counters = await wait_engine_idle(engine.address)
            assert counters["requests_accepted"] == 2


@pytest.mark.soak
async def test_random_cancels_and_disconnects_leak_nothing(aio_loop: Any, tmp_path: Path) -> None:
    """500 streams, 50 at a time, cancelled or disconnected at random points: exactly one Abort per
    stream that ended cancelled, none for completed ones, and nothing left on the engine."""
    rng = random.Random(1234)
    outcomes: dict[str, str] = {}
    disconnected: set[str] = set()
    with trio.fail_after(120):
        async with (
            mock_engine(
                tmp_path, "--flavor", "vllm", "--token-delay-ms", "2", "--max-running", "64"
            ) as engine,
            sidecar(engine.address) as sc,
        ):

            async def connection(worker: int, limiter: trio.CapacityLimiter) -> None:
                for i in range(10):
                    rid = f"w{worker}-{i}"
                    mode = rng.choice(["complete", "cancel", "cancel", "disconnect"])
                    after = rng.randint(0, 12)
                    async with limiter:
                        try:
                            async with open_sidecar(sc.ws) as client:
                                async with client.generate(
                                    generate_request(max_tokens=40, requestId=rid)
                                ) as s:
                                    n = 0
                                    async for _ in s:
                                        n += 1
                                        if mode != "complete" and n >= after:
                                            break
                                    if mode == "disconnect" and s.end is None:
                                        disconnected.add(rid)
                                        raise _Disconnect
                                outcomes[rid] = s.end.outcome if s.end else "none"
                        except* (_Disconnect, SidecarConnectionError):
                            pass

            limiter = trio.CapacityLimiter(50)
            async with trio.open_nursery() as nursery:
                for w in range(50):
                    nursery.start_soon(connection, w, limiter)
            await wait_engine_idle(engine.address, timeout=30)
            cancelled = [rid for rid, o in outcomes.items() if o == "cancelled"]
            counters = await eventually(partial(counters_once_aborted, engine.address, cancelled), timeout=20)
            retries = (await scrape(sc.http)).value("openengine_sidecar_abort_retries_total")
    by_id = counters["aborts_received_by_id"]
    assert counters["requests_leaked"] == 0
    assert counters["streams_open"] == 0
    assert len(outcomes) + len(disconnected) == 500
    extra = 0
    for rid, outcome in outcomes.items():
        if outcome == "completed":
            assert by_id.get(rid, 0) == 0, rid
        else:
            assert outcome == "cancelled", (rid, outcome)
            assert by_id.get(rid, 0) >= 1, rid
            extra += by_id[rid] - 1
    for rid in disconnected:
        extra += max(0, by_id.get(rid, 0) - 1)
    # exactly one Abort per stream, but for an attempt that outlived --abort-timeout on a
    # saturated machine: the sidecar retries it (Abort is idempotent) and counts the retry
    assert extra <= retries, (extra, retries)
    assert sum(1 for o in outcomes.values() if o == "cancelled") > 150


class _Disconnect(Exception):
    pass


async def test_drain_finishes_admitted_and_refuses_new(aio_loop: Any, tmp_path: Path) -> None:
    with trio.fail_after(60):
        async with (
            mock_engine(tmp_path, "--flavor", "vllm", "--token-delay-ms", "40") as engine,
            sidecar(engine.address, "--drain-timeout", "15") as sc,
        ):
            ends: list[Any] = []
            started = trio.Semaphore(0)
            async with open_sidecar(sc.ws) as client:

                async def one(i: int) -> None:
                    async with client.generate(generate_request(max_tokens=50, requestId=f"d{i}")) as s:
                        first = True
                        async for _ in s:
                            if first:
                                started.release()
                                first = False
                    ends.append(s.end)

                async with trio.open_nursery() as nursery:
                    nursery.cancel_scope.deadline = trio.current_time() + 30
                    for i in range(16):
                        nursery.start_soon(one, i)
                    for _ in range(16):
                        await started.acquire()
                    t0 = trio.current_time()
                    sc.proc.signal(signal.SIGTERM)
                    await sc.proc.wait_for_line(re.compile("draining"))
                    assert (await http_get(sc.http + "/ready")).status_code == 503
                    async with client.generate(generate_request()) as late:
                        assert [e async for e in late] == []
                    assert late.end.outcome == "rejected"
                    assert late.end.error.code == "ERROR_CODE_DRAINING" and late.end.error.retryable
            assert [e.outcome for e in ends] == ["completed"] * 16, sc.proc.lines
            assert await sc.proc.wait(timeout=20) == 0
            assert trio.current_time() - t0 < 15 + 1
            counters = await wait_engine_idle(engine.address)
            assert counters["requests_completed"] == 16 and counters["aborts_received"] == 0


async def test_drain_deadline_cancels_and_aborts(aio_loop: Any, tmp_path: Path) -> None:
    with trio.fail_after(60):
        async with (
            mock_engine(tmp_path, "--flavor", "vllm", "--token-delay-ms", "50") as engine,
            sidecar(engine.address, "--drain-timeout", "0.5") as sc,
        ):
            async with open_sidecar(sc.ws) as client:
                async with client.generate(generate_request(max_tokens=1000, requestId="long")) as s:
                    async for _ in s:
                        sc.proc.signal(signal.SIGTERM)
                        break
                    end = await s.wait_end()
            assert end.outcome == "cancelled" and end.error.code == "ERROR_CODE_DRAINING"
            assert await sc.proc.wait(timeout=10) == 0
            counters = await wait_engine_idle(engine.address)
            assert counters["aborts_received_by_id"] == {"long": 1}
            assert counters["requests_leaked"] == 0


async def test_engine_killed_mid_stream_then_recovers(aio_loop: Any, tmp_path: Path) -> None:
    with trio.fail_after(90):
        async with mock_engine(tmp_path, "--flavor", "vllm", "--token-delay-ms", "20") as engine:
            async with sidecar(engine.address, "--health-interval", "0.2") as sc:
                ends: list[Any] = []
                async with open_sidecar(sc.ws) as client:

                    async def one(i: int, crash: bool) -> None:
                        extra = {"mock": {"faults": ["crash-after=3"]}} if crash else None
                        req = (
                            generate_request(max_tokens=200, extra=extra)
                            if crash
                            else generate_request(max_tokens=200)
                        )
                        async with client.generate(req) as s:
                            async for _ in s:
                                pass
                        ends.append((s.end, trio.current_time()))

                    async with trio.open_nursery() as nursery:
                        for i in range(4):
                            nursery.start_soon(one, i, False)
                        nursery.start_soon(one, 4, True)
                crash_at = max(t for _, t in ends)
                assert all(e.outcome == "failed" and e.error.retryable for e, _ in ends), ends
                assert max(t for _, t in ends) - min(t for _, t in ends) < 1.0
                assert await engine.proc.wait(timeout=5) == 70
                await eventually(lambda: ready_status(sc, 503), 5)
                assert "unreachable" in (await http_get(sc.http + "/ready")).json()["reason"]
                assert crash_at  # the sidecar is still up:
                assert (await http_get(sc.http + "/health")).status_code == 200
                async with mock_engine(tmp_path, "--flavor", "vllm") as engine2:
                    assert engine2.address == engine.address
                    await eventually(lambda: ready_status(sc, 200), 15)
                    _events, end = await run_one(sc.ws, generate_request(max_tokens=3))
                    assert end.outcome == "completed"


async def test_restarted_engine_with_other_role_is_not_served(aio_loop: Any, tmp_path: Path) -> None:
    with trio.fail_after(90):
        async with mock_engine(tmp_path, "--flavor", "vllm") as engine:
            sc_cm = sidecar(engine.address, "--health-interval", "0.2")
            async with sc_cm as sc:
                engine.proc.signal(signal.SIGKILL)
                await engine.proc.wait()
                async with mock_engine(tmp_path, "--flavor", "vllm", "--role", "prefill"):

                    async def role_changed() -> bool:
                        r = await http_get(sc.http + "/ready")
                        return r.status_code == 503 and "role changed" in r.json()["reason"]

                    await eventually(role_changed, 15)
                    events, end = await run_one(sc.ws, generate_request())
                    assert end.outcome == "rejected" and events == []


async def test_protocol_violation_fails_only_that_stream(aio_loop: Any, tmp_path: Path) -> None:
    with trio.fail_after(60):
        async with (
            mock_engine(tmp_path, "--flavor", "vllm", "--token-delay-ms", "5") as engine,
            sidecar(engine.address) as sc,
        ):
            results: dict[str, Any] = {}
            async with open_sidecar(sc.ws) as client:

                async def one(name: str, req: dict[str, Any]) -> None:
                    async with client.generate(req) as s:
                        async for _ in s:
                            pass
                    results[name] = s.end

                async with trio.open_nursery() as nursery:
                    bad = generate_request(max_tokens=5, extra={"mock": {"faults": ["token-after-finish"]}})
                    nursery.start_soon(one, "bad", bad)
                    nursery.start_soon(
                        one,
                        "bad2",
                        generate_request(
                            max_tokens=5, extra={"mock": {"faults": ["close-without-terminal=2"]}}
                        ),
                    )
                    nursery.start_soon(one, "good", generate_request(max_tokens=30))
            assert results["good"].outcome == "completed"
            assert results["bad"].outcome == "failed" and "after" in results["bad"].error.message
            assert (
                results["bad2"].outcome == "failed" and "without a terminal" in results["bad2"].error.message
            )
            assert (await http_get(sc.http + "/ready")).status_code == 200


async def test_malformed_undecodable_and_oversized_frames(aio_loop: Any, tmp_path: Path) -> None:
    with trio.fail_after(60):
        async with (
            mock_engine(tmp_path, "--flavor", "vllm") as engine,
            sidecar(engine.address, "--max-message-size", "65536") as sc,
        ):
            async with open_websocket_url(sc.ws) as ws:
                await ws.send_message(json.dumps({"type": "bogus"}))
                assert json.loads(await ws.get_message())["type"] == "protocol_error"
                await ws.send_message(json.dumps({"type": "cancel", "stream": "never-opened"}))
                await ws.send_message(json.dumps({"type": "generate", "stream": 5, "request": {"prompt": 3}}))
                reply = json.loads(await ws.get_message())
                assert reply["type"] == "end" and reply["outcome"] == "rejected" and reply["stream"] == 5
            async with open_websocket_url(sc.ws) as ws:
                await ws.send_message("{not json")
                with pytest.raises(ConnectionClosed) as closed:
                    await ws.get_message()
                assert closed.value.reason.code == 1007
            async with open_websocket_url(sc.ws) as ws:
                await ws.send_message("x" * 70000)
                with pytest.raises(ConnectionClosed) as closed:
                    await ws.get_message()
                assert closed.value.reason.code == 1009
            _events, end = await run_one(sc.ws, generate_request(max_tokens=2))
            assert end.outcome == "completed"
            assert (await engine_counters(engine.address))["requests_accepted"] == 1


@pytest.mark.parametrize(
    ("engine_args", "sidecar_args", "needle"),
    [
        (["--fault", "wrong-revision=0"], [], "revision"),
        (["--fault", "wrong-min-client=4"], [], "minimum_client_revision 4 above its own"),
        (["--fault", "wrong-revision=5", "--fault", "wrong-min-client=4"], [], "minimum_client_revision 4"),
        (["--fault", "wrong-release=main"], [], "release"),
        (["--fault", "wrong-release=a66ff6f"], [], "release"),
        ([], ["--expected-engine", "sglang"], "sglang"),
        ([], ["--expected-schema-release", "b" * 40], "release"),
    ],
)
async def test_negotiation_fails_closed(
    aio_loop: Any, tmp_path: Path, engine_args: list[str], sidecar_args: list[str], needle: str
) -> None:
    from tests.e2e.harness import spawn

    with trio.fail_after(60):
        async with mock_engine(tmp_path, "--flavor", "vllm", *engine_args) as engine:
            async with spawn(
                [
                    "run",
                    "--engine",
                    engine.address,
                    "--listen",
                    "127.0.0.1:0",
                    "--http-listen",
                    "127.0.0.1:0",
                    *sidecar_args,
                ]
            ) as proc:
                assert await proc.wait(timeout=30) == 1
            last = proc.lines[-1]
            assert last.startswith("openengine-sidecar: ") and needle in last.lower(), proc.lines


async def test_newer_additive_server_revision_is_accepted(aio_loop: Any, tmp_path: Path) -> None:
    with trio.fail_after(60):
        async with (
            mock_engine(tmp_path, "--flavor", "vllm", "--fault", "wrong-revision=7") as engine,
            sidecar(engine.address) as sc,
        ):
            async with open_sidecar(sc.ws) as client:
                card = await client.call("describe")
            assert card["schema"]["serverRevision"] == 7 and card["schema"]["serverNewer"] is True
            assert card["schema"]["revision"] == 3


async def test_unreachable_engine_times_out_at_startup_deadline(tmp_path: Path) -> None:
    from tests.e2e.harness import spawn

    with trio.fail_after(30):
        async with spawn(
            ["run", "--engine", f"unix://{tmp_path}/none.sock", "--startup-deadline", "1"]
        ) as proc:
            assert await proc.wait(timeout=20) == 1
        assert "not ready after 1s" in proc.lines[-1]


async def test_second_signal_cancels_everything_at_once(aio_loop: Any, tmp_path: Path) -> None:
    with trio.fail_after(60):
        async with (
            mock_engine(tmp_path, "--flavor", "vllm", "--token-delay-ms", "50") as engine,
            sidecar(engine.address, "--drain-timeout", "60") as sc,
        ):
            async with open_sidecar(sc.ws) as client:
                async with client.generate(generate_request(max_tokens=1000, requestId="slow")) as s:
                    async for _ in s:
                        break
                    sc.proc.signal(signal.SIGTERM)
                    await sc.proc.wait_for_line(re.compile("draining"))
                    t0 = trio.current_time()
                    sc.proc.signal(signal.SIGINT)
                    end = await s.wait_end()
            assert end.outcome == "cancelled"
            assert await sc.proc.wait(timeout=10) == 0
            assert trio.current_time() - t0 < 3  # not the 60 s grace
            counters = await wait_engine_idle(engine.address)
            assert counters["aborts_received_by_id"] == {"slow": 1} and counters["requests_leaked"] == 0


@pytest.mark.parametrize("engine_has_drain", [True, False])
async def test_drain_engine_flag(aio_loop: Any, tmp_path: Path, engine_has_drain: bool) -> None:
    fault = [] if engine_has_drain else ["--fault", "no-drain"]
    with trio.fail_after(60):
        async with (
            mock_engine(tmp_path, "--flavor", "vllm", "--token-delay-ms", "20", *fault) as engine,
            sidecar(engine.address, "--drain-engine", "--drain-timeout", "10") as sc,
        ):
            async with open_sidecar(sc.ws) as client:
                async with client.generate(generate_request(max_tokens=30, requestId="inflight")) as s:
                    async for _ in s:
                        break
                    sc.proc.signal(signal.SIGTERM)
                    end = await s.wait_end()
            assert end.outcome == "completed"
            assert await sc.proc.wait(timeout=15) == 0
            log = "\n".join(sc.proc.lines)
            if engine_has_drain:
                assert "engine drain: DRAIN_STATE_STARTED" in log
                async with open_engine_client(engine.address) as ec:
                    health = await ec.health()
                assert health.state == pb.HealthState.DRAINING
            else:
                assert "engine has no Drain RPC; draining locally only" in log


async def test_a_stopped_sidecar_says_how_long_it_could_not_run(aio_loop: Any, tmp_path: Path) -> None:
    """SIGSTOP for 1.5 s (what a starved CPU looks like to clients): after SIGCONT the log names
    the stall and ``event_loop_stalls_total`` counts it."""
    with trio.fail_after(60):
        async with mock_engine(tmp_path) as engine, sidecar(engine.address) as sc:
            sc.proc.signal(signal.SIGSTOP)
            await trio.sleep(1.5)  # the fault's length, not a synchronization
            sc.proc.signal(signal.SIGCONT)
            line = await sc.proc.wait_for_line(
                re.compile(r"event loop stalled: could not run for (\d+\.\d)s")
            )
            assert float(line.group(1)) >= 1.0
            assert (await scrape(sc.http)).value("openengine_sidecar_event_loop_stalls_total") >= 1
