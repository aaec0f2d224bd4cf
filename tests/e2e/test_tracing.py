"""Traces end to end: simulated engines, sidecars (``run --otlp-endpoint``) and a real OTLP/HTTP
receiver (``tests/otlp_receiver.py``) decoding what the sidecar's exporter sent.

Each test reads the span tree of one situation: a cancelled stream with its Abort and the
answer, an Abort that overtook its request and was confirmed, a P/D flow, a drain refusal.
"""

from __future__ import annotations

import re
import signal
from pathlib import Path
from typing import Any

import pytest
import trio

from sidecar.client.disagg import open_disagg
from sidecar.client.sidecar_client import open_sidecar
from tests.e2e.harness import (
    engine_counters,
    eventually,
    generate_request,
    mock_engine,
    sidecar,
    wait_engine_idle,
)
from tests.e2e.test_disagg import PROMPT, SIDECAR_ARGS, recent
from tests.otlp_receiver import Receiver, Span, otlp_receiver

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{CLIENT_SPAN}-01"


@pytest.fixture(autouse=True)
def _fast_export(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sidecars started here export every 100 ms (the SDK's standard variable; 5 s by default)."""
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")


async def stream_open(address: str) -> bool:
    return bool((await engine_counters(address))["streams_open"])


def generate_span(rx: Receiver, request_id: str) -> Span | None:
    found = [s for s in rx.spans("generate") if s.attributes.get("openengine.request_id") == request_id]
    return found[0] if found else None


async def test_a_cancelled_streams_trace_shows_its_abort_and_the_answer(
    aio_loop: Any, tmp_path: Path
) -> None:
    """One ``generate`` span under the client's span: admitted, first token, cancel, the Abort
    sent and answered, end; the Abort call is a child span answered ``aborted``; the engine got
    the sidecar span's ``traceparent`` (its own spans would nest under it)."""
    with otlp_receiver() as rx, trio.fail_after(30):
        async with (
            mock_engine(tmp_path, "--token-delay-ms", "20") as engine,
            sidecar(engine.address, "--otlp-endpoint", rx.url) as sc,
            open_sidecar(sc.ws) as client,
        ):
            request = generate_request(max_tokens=500, requestId="traced")
            async with client.generate(request, {"traceparent": TRACEPARENT}) as s:
                async for _ in s:
                    break
                await s.cancel()
                end = await s.wait_end()
            assert end.outcome == "cancelled"
            await wait_engine_idle(engine.address)
            span = await eventually(lambda: generate_span(rx, "traced"))
            [abort] = await eventually(lambda: rx.children(span))
            got = (await recent(engine.address))["traced"]["metadata"]

    assert (span.trace_id, span.parent_id, span.kind) == (TRACE_ID, CLIENT_SPAN, "server")
    assert span.resource["service.name"] == "openengine-sidecar"
    assert span.event_names() == ["admitted", "first_token", "cancel", "abort.sent", "abort.answered", "end"]
    assert span.event("cancel") == {"openengine.message": "cancelled by the client"}
    assert span.event("abort.answered") == {"openengine.abort.result": "aborted"}
    attrs = span.attributes
    assert attrs["gen_ai.request.model"] == "Qwen/Qwen3-0.6B"
    assert attrs["openengine.role"] == "aggregated"
    assert attrs["openengine.outcome"] == "cancelled"
    assert attrs["openengine.error_code"] == "ERROR_CODE_CANCELLED"
    assert attrs["gen_ai.usage.output_tokens"] >= 1
    assert span.status == "unset"
    assert (abort.name, abort.kind, abort.trace_id) == ("Abort", "client", TRACE_ID)
    assert abort.attributes == {"openengine.abort.state": "sending", "openengine.abort.result": "aborted"}
    assert span.start <= abort.start <= abort.end <= span.end
    assert got["traceparent"] == f"00-{TRACE_ID}-{span.span_id}-01"


async def test_an_abort_that_overtook_its_request_is_traced_with_its_confirmation(
    aio_loop: Any, tmp_path: Path
) -> None:
    """The request reaches the engine after its Abort (fault ``late-generate``): the first
    Abort span is answered ``not_found`` within the stream's span, the confirmation 1 s later
    is a second Abort span under it (state ``confirming``) that finds and aborts the request."""
    with otlp_receiver() as rx, trio.fail_after(30):
        async with (
            mock_engine(tmp_path, "--fault", "late-generate=0.8", "--orphan-timeout", "60") as engine,
            sidecar(engine.address, "--otlp-endpoint", rx.url) as sc,
            open_sidecar(sc.ws) as client,
        ):
            async with client.generate(generate_request(max_tokens=500, requestId="late")) as s:
                # the stream is open on the engine, the request not yet registered (0.8 s)
                await eventually(lambda: stream_open(engine.address), timeout=5)
                await s.cancel()
                end = await s.wait_end()
            assert end.outcome == "cancelled"
            span = await eventually(lambda: generate_span(rx, "late"))
            aborts = await eventually(lambda: (lambda c: c if len(c) == 2 else None)(rx.children(span)))
            counters = await wait_engine_idle(engine.address)
    assert counters["requests_leaked"] == 0 and counters["orphans_aborted"] == 1
    assert span.parent_id == ""  # no traceparent from the client: a trace of its own
    assert "first_token" not in span.event_names()
    assert span.event("abort.answered") == {"openengine.abort.result": "not_found"}
    first, confirm = sorted(aborts, key=lambda a: a.start)
    assert first.attributes == {"openengine.abort.state": "sending", "openengine.abort.result": "not_found"}
    assert confirm.attributes == {
        "openengine.abort.state": "confirming",
        "openengine.abort.result": "aborted",
    }
    assert first.end <= span.end < confirm.start


async def test_a_pd_flows_trace_holds_the_prefill_and_the_decode(aio_loop: Any, tmp_path: Path) -> None:
    """The coordinator forwards the client's ``traceparent`` to both sidecars: one trace, a
    ``generate`` span per role under the client's span, the prefill's marked as handing its KV
    session over, the decode's with the tokens it relayed."""
    with otlp_receiver() as rx, trio.fail_after(30):
        async with (
            mock_engine(tmp_path, "--role", "prefill", name="prefill") as pe,
            mock_engine(tmp_path, "--role", "decode", name="decode") as de,
            sidecar(pe.address, *SIDECAR_ARGS, "--otlp-endpoint", rx.url) as ps,
            sidecar(de.address, *SIDECAR_ARGS, "--otlp-endpoint", rx.url) as ds,
        ):
            async with open_disagg([ps.ws], [ds.ws]) as coordinator:
                request = generate_request(PROMPT, max_tokens=6)
                async with coordinator.generate(request, {"traceparent": TRACEPARENT}) as flow:
                    [e async for e in flow]
            flow.check()

            def both() -> list[Span] | None:
                spans = rx.trace(TRACE_ID)
                return spans if len(spans) == 2 else None

            spans = await eventually(both)
    by_role = {s.attributes["openengine.role"]: s for s in spans}
    prefill, decode = by_role["prefill"], by_role["decode"]
    assert prefill.parent_id == decode.parent_id == CLIENT_SPAN
    assert {s.name for s in spans} == {"generate"}
    assert prefill.attributes["openengine.kv_session"] is True
    assert prefill.attributes["openengine.outcome"] == decode.attributes["openengine.outcome"] == "completed"
    assert decode.attributes["gen_ai.usage.output_tokens"] == 6
    assert decode.attributes["gen_ai.usage.input_tokens"] == 19
    assert "openengine.kv_session" not in decode.attributes
    assert prefill.end <= decode.start


async def test_a_drain_refusal_is_a_span_of_its_own(aio_loop: Any, tmp_path: Path) -> None:
    """A request that arrives while the sidecar drains is refused DRAINING: its span has the
    ``refused`` event and an error status; the stream cut by the drain deadline ends
    ``cancelled`` with code DRAINING."""
    with otlp_receiver() as rx, trio.fail_after(30):
        async with (
            mock_engine(tmp_path, "--token-delay-ms", "50") as engine,
            sidecar(engine.address, "--otlp-endpoint", rx.url, "--drain-timeout", "1") as sc,
            open_sidecar(sc.ws) as client,
        ):
            async with client.generate(generate_request(max_tokens=1000, requestId="long")) as long:
                async for _ in long:
                    break
                sc.proc.signal(signal.SIGTERM)
                await sc.proc.wait_for_line(re.compile(r"draining: 1 stream"))
                refused = generate_request(requestId="late-comer")
                async with client.generate(refused, {"traceparent": TRACEPARENT}) as s:
                    end = await s.wait_end()
                assert end.outcome == "rejected" and end.error.code == "ERROR_CODE_DRAINING"
                async with client.generate(generate_request(requestId="no-metadata")) as s:
                    end = await s.wait_end()
                assert end.outcome == "rejected" and end.error.code == "ERROR_CODE_DRAINING"
                await long.wait_end()
            assert await sc.proc.wait(timeout=10) == 0  # the last spans left before the exit
    refusal = generate_span(rx, "late-comer")
    assert refusal is not None and refusal.parent_id == CLIENT_SPAN
    assert refusal.event_names() == ["refused"]
    assert refusal.event("refused")["openengine.error_code"] == "ERROR_CODE_DRAINING"
    assert refusal.status == "error" and refusal.attributes["openengine.outcome"] == "rejected"
    bare = generate_span(rx, "no-metadata")
    assert bare is not None and bare.parent_id == "" and bare.event_names() == ["refused"]
    cut = generate_span(rx, "long")
    assert cut is not None and "cancel" in cut.event_names()
    assert cut.attributes["openengine.error_code"] == "ERROR_CODE_DRAINING"


async def test_a_retried_abort_is_one_span_per_call(aio_loop: Any, tmp_path: Path) -> None:
    """The engine refuses the first Abort (fault ``drop-aborts=1``: UNAVAILABLE): that call's
    span says ``refused`` with an error status, the retry's ``aborted``."""
    with otlp_receiver() as rx, trio.fail_after(30):
        async with (
            mock_engine(tmp_path, "--token-delay-ms", "20", "--fault", "drop-aborts=1") as engine,
            sidecar(engine.address, "--otlp-endpoint", rx.url) as sc,
            open_sidecar(sc.ws) as client,
        ):
            async with client.generate(generate_request(max_tokens=500, requestId="retried")) as s:
                async for _ in s:
                    break
                await s.cancel()
                await s.wait_end()
            span = await eventually(lambda: generate_span(rx, "retried"))
            aborts = await eventually(lambda: (lambda c: c if len(c) == 2 else None)(rx.children(span)))
            counters = await wait_engine_idle(engine.address)
    assert counters["requests_leaked"] == 0
    first, retry = sorted(aborts, key=lambda a: a.start)
    assert (first.attributes["openengine.abort.result"], first.status) == ("refused", "error")
    assert (retry.attributes["openengine.abort.result"], retry.status) == ("aborted", "unset")
    assert span.event("abort.answered") == {"openengine.abort.result": "refused"}
