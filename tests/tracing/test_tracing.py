"""sidecar.tracing: when tracing is on, what a collector receives, and that a slow, hung or dead
collector costs a counter and bounded memory, never a stream's time."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import trio

from sidecar.metrics_registry import REGISTRY
from sidecar.tracing import DEFAULT_MAX_QUEUE, TracingConfig, TracingConfigError, open_tracer, tracing_config
from sidecar.tracing.otel import Tracer, build_tracer
from tests.otlp_receiver import otlp_receiver
from tests.polling import eventually

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def spans_counted(result: str) -> float:
    return REGISTRY.get_sample_value("openengine_sidecar_trace_spans_total", {"result": result}) or 0.0


# -- when it is on --------------------------------------------------------------------------


def test_off_unless_a_collector_is_named() -> None:
    assert tracing_config(None, {}) is None
    assert tracing_config(None, {"OTEL_SERVICE_NAME": "x"}) is None


@pytest.mark.parametrize(
    ("endpoint", "url"),
    [
        ("http://collector:4318", "http://collector:4318/v1/traces"),
        ("http://collector:4318/", "http://collector:4318/v1/traces"),
        ("https://collector/otlp/v1/traces", "https://collector/otlp/v1/traces"),
    ],
)
def test_the_flag_names_the_collectors_base_url(endpoint: str, url: str) -> None:
    assert tracing_config(endpoint, {}) == TracingConfig(url, DEFAULT_MAX_QUEUE)


def test_opentelemetrys_own_variables_turn_it_on_and_tune_it() -> None:
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_BSP_MAX_QUEUE_SIZE": "100"}
    assert tracing_config(None, env) == TracingConfig(None, 100)  # the exporter reads the URL itself
    assert tracing_config(None, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}) is not None
    for off in ({"OTEL_SDK_DISABLED": "true"}, {"OTEL_TRACES_EXPORTER": "none"}):
        assert tracing_config("http://c:4318", {**env, **off}) is None


@pytest.mark.parametrize(
    ("endpoint", "env", "says"),
    [
        ("ftp://c", {}, "--otlp-endpoint must be an http:// or https:// URL"),
        ("http://", {}, "--otlp-endpoint must be an http:// or https:// URL"),
        (None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "c:4317"}, "OTEL_EXPORTER_OTLP_ENDPOINT must be an http://"),
        ("http://c", {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, "OTLP protocol 'grpc' is not supported"),
        ("http://c", {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json"}, "OTLP protocol 'http/json'"),
        ("http://c", {"OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER=zipkin is not supported"),
        ("http://c", {"OTEL_BSP_MAX_QUEUE_SIZE": "0"}, "OTEL_BSP_MAX_QUEUE_SIZE must be 1 to 1000000"),
    ],
)
def test_unusable_settings_are_one_line_errors(endpoint: str | None, env: dict[str, str], says: str) -> None:
    with pytest.raises(TracingConfigError, match="^" + re.escape(says)):
        tracing_config(endpoint, env)


def test_a_bad_setting_stops_run_at_parse_time_in_one_line() -> None:
    env = {"PATH": "/usr/bin:/bin", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "sidecar",
            "run",
            "--engine",
            "unix:///nonexistent",
            "--otlp-endpoint",
            "http://c",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    [line] = proc.stderr.strip().splitlines()
    assert "--otlp-endpoint" in line and "'grpc' is not supported" in line


def test_with_tracing_off_the_sdk_is_never_imported() -> None:
    """Zero cost off: a sidecar process that serves without tracing loads no OpenTelemetry module."""
    code = (
        "import sys, sidecar.cli, sidecar.run_command, sidecar.core.sidecar, sidecar.kvbridge.service\n"
        "from sidecar.tracing import tracing_config\n"
        "assert tracing_config(None, {}) is None\n"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(out.stdout.replace("'", '"')) == []


# -- what leaves, and what a bad collector costs ---------------------------------------------


@pytest.fixture
def closed_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


def stream(tracer: Tracer, n: int = 0) -> None:
    """What one stream does to the tracer: start, three events, an Abort call, end."""
    trace = tracer.start_stream(
        traceparent=TRACEPARENT, tracestate=None, start_ns=time.time_ns(), attributes={"n": n}
    )
    trace.event("admitted")
    trace.event("first_token")
    trace.abort_call("sending").answered("aborted")
    trace.end({"openengine.outcome": "cancelled"}, None)


async def test_spans_reach_the_collector(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "sidecar-7")
    exported = spans_counted("exported")
    with otlp_receiver() as rx, trio.fail_after(10):
        async with open_tracer(tracing_config(rx.url, {})) as tracer:
            assert tracer is not None
            stream(tracer)
            [generate] = await eventually(lambda: rx.spans("generate"))
            [abort] = await eventually(lambda: rx.spans("Abort"))
    assert generate.resource["service.name"] == "sidecar-7"
    assert generate.parent_id == "00f067aa0ba902b7" and abort.parent_id == generate.span_id
    assert spans_counted("exported") - exported == 2


async def test_a_hung_collector_costs_bounded_memory_and_a_counter_not_latency(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The collector takes a request and never answers: the export thread waits, the queue
    fills up to its bound, every span past it is dropped and counted; ending spans stays as
    cheap as ever. Once the collector answers again, what was queued is exported."""
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "20")
    full, exported = spans_counted("queue_full"), spans_counted("exported")
    with otlp_receiver() as rx:
        tracer = build_tracer(TracingConfig(rx.url + "/v1/traces", max_queue=64))
        try:
            with rx.hold():
                stream(tracer)  # 2 spans: the export thread takes them and hangs on the collector
                await eventually(lambda: rx.requests_waiting, timeout=5)
                t0 = time.perf_counter()
                for n in range(500):
                    stream(tracer, n)
                elapsed = time.perf_counter() - t0
                dropped = spans_counted("queue_full") - full
                # 64 wait (63 when one of the first stream's spans is queued behind its hung batch)
                assert 1000 - 64 <= dropped <= 1000 - 63
            await eventually(lambda: spans_counted("exported") - exported == 1002 - dropped, timeout=10)
        finally:
            await trio.to_thread.run_sync(tracer.shutdown)
    assert elapsed < 1.0, f"500 streams' spans took {elapsed:.2f}s with the collector hung"


async def test_a_dead_collector_is_counted_as_failed_exports(
    monkeypatch: pytest.MonkeyPatch, closed_port: int
) -> None:
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "20")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "0.5")
    failed = spans_counted("export_failed")
    tracer = build_tracer(TracingConfig(f"http://127.0.0.1:{closed_port}/v1/traces", max_queue=64))
    try:
        t0 = time.perf_counter()
        for n in range(10):
            stream(tracer, n)
        assert time.perf_counter() - t0 < 0.5
        await eventually(lambda: spans_counted("export_failed") - failed == 20, timeout=10)
    finally:
        with trio.move_on_after(5):
            await trio.to_thread.run_sync(tracer.shutdown, abandon_on_cancel=True)
