"""The P/D coordinator's flows against scripted fake sidecars (real WebSockets, no engines).

Each fake serves ``describe`` with a real worker card and answers every ``generate`` with one
scripted behaviour, recording what it received. End-to-end runs with engines are in
tests/e2e/test_disagg.py.
"""

from __future__ import annotations

import io
import json
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
import trio
from trio_websocket import ConnectionClosed, WebSocketConnection, WebSocketRequest, serve_websocket

from sidecar.client.commands import run_disagg
from sidecar.client.disagg import DisaggError, open_disagg
from sidecar.north import codec
from sidecar.north.codec import CallCommand, CancelCommand, GenerateCommand
from sidecar.openengine import pb
from tests.client.test_disagg import card

CONTEXT_SESSION = bytes(pb.KvSessionRef(session_id="s1", handoff_profile="vllm.kv_transfer_params.v1")) + (
    b"\x9a\x06\x02hi"  # unknown field 99: must reach the decode unchanged
)
REQUEST = {"model": "Qwen/Qwen3-0.6B", "prompt": "hello", "stopping": {"maxTokens": 3}}


@dataclass
class Fake:
    """A sidecar: ``card`` for describe; ``behaviours`` for its generates in turn (the last one
    repeats); with ``wait_for``, each generate first waits for that event."""

    card: dict[str, Any]
    behaviours: list[str]
    wait_for: trio.Event | None = None
    port: int = 0
    generates: list[GenerateCommand] = field(default_factory=list)
    cancels: list[Any] = field(default_factory=list)
    started: trio.Event = field(default_factory=trio.Event)

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}"

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            server = await nursery.start(serve_websocket, self._handle, "127.0.0.1", 0, None)
            self.port = server.port
            task_status.started(self)

    async def _handle(self, request: WebSocketRequest) -> None:
        ws = await request.accept()
        cancelled: dict[Any, trio.Event] = {}
        try:
            async with trio.open_nursery() as nursery:
                while True:
                    cmd = codec.decode_frame(await ws.get_message())
                    if isinstance(cmd, GenerateCommand):
                        self.generates.append(cmd)
                        cancelled[cmd.stream] = trio.Event()
                        nursery.start_soon(self._generate, ws, cmd, cancelled[cmd.stream])
                    elif isinstance(cmd, CancelCommand):
                        self.cancels.append(cmd.stream)
                        if cmd.stream in cancelled:
                            cancelled[cmd.stream].set()
                    elif isinstance(cmd, CallCommand):
                        reply = codec.result_ok(cmd.call, self.card)
                        await ws.send_message(codec.encode(reply, cmd.encoding))
        except* ConnectionClosed:
            pass

    async def _generate(self, ws: WebSocketConnection, cmd: GenerateCommand, cancelled: trio.Event) -> None:
        events = codec.EventEncoder(cmd.stream, cmd.encoding)
        b = self.behaviours.pop(0) if len(self.behaviours) > 1 else self.behaviours[0]
        self.started.set()
        if self.wait_for is not None:
            await self.wait_for.wait()

        async def end(outcome: str, code: pb.ErrorCode | None = None, retryable: bool = False) -> None:
            error = None if code is None else codec.error_body(code, f"fake {outcome}", retryable)
            await ws.send_message(codec.encode(codec.end_message(cmd.stream, outcome, error), cmd.encoding))

        async def prefill_ready(session: bytes) -> None:
            ref = pb.KvSessionRef.parse(session)
            resp = pb.GenerateResponse(request_id="p", prefill_ready=pb.PrefillReady(kv_session=ref))
            await ws.send_message(events.encode(resp, kv_session_bytes=session))

        async def tokens(n: int) -> None:
            for i in range(n):
                tok = pb.TokenOutput(output_index=0, tokens=[pb.TokenInfo(token_id=i, token="t")], text="t")
                await ws.send_message(events.encode(pb.GenerateResponse(request_id="d", token=tok)))

        if b == "prefill":  # context-first: hand out CONTEXT_SESSION
            await prefill_ready(CONTEXT_SESSION)
            await end("completed")
        elif b == "prefill-echo":  # bootstrap: echo the session the request carried
            assert cmd.kv_session_bytes is not None
            await prefill_ready(cmd.kv_session_bytes)
            await end("completed")
        elif b == "prefill-wrong-room":
            ref = pb.KvSessionRef.parse(cmd.kv_session_bytes or b"")
            assert ref.bootstrap is not None
            ref.bootstrap.room_id += 1
            await prefill_ready(bytes(ref))
            await end("completed")
        elif b == "decode":
            await tokens(3)
            finished = pb.GenerateResponse(
                request_id="d",
                finished=pb.GenerationFinished(output_index=0, reason=pb.FinishReason.LENGTH),
                usage=pb.Usage(prompt_tokens=1, completion_tokens=3, total_tokens=4),
            )
            await ws.send_message(events.encode(finished))
            await end("completed")
        elif b == "overloaded":
            await end("rejected", pb.ErrorCode.OVERLOADED, retryable=True)
        elif b == "transfer-failed":  # a decode that could not get the KV from its prefill
            # as a real sidecar relays an engine's failure: its error event, then the end
            error = pb.EngineError(code=pb.ErrorCode.KV_TRANSFER_FAILED, message="no KV", retryable=True)
            await ws.send_message(events.encode(pb.GenerateResponse(request_id="d", error=error)))
            await end("failed", pb.ErrorCode.KV_TRANSFER_FAILED, retryable=True)
        elif b == "refuse-late":  # a prefill whose refusal comes after its decode's failure
            with trio.move_on_after(0.5):
                await cancelled.wait()
            if cancelled.is_set():
                await end("cancelled", pb.ErrorCode.CANCELLED, retryable=True)
            else:
                await end("rejected", pb.ErrorCode.INTERNAL, retryable=True)
        elif b == "invalid":
            await end("rejected", pb.ErrorCode.INVALID_ARGUMENT)
        elif b in ("hang", "hang-tokens"):
            if b == "hang-tokens":
                await tokens(1)
            await cancelled.wait()
            await end("cancelled", pb.ErrorCode.CANCELLED)
        elif b == "die":
            await ws.aclose(1011, "crashed")


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"ws://127.0.0.1:{port}"


@asynccontextmanager
async def fakes(*specs: tuple[str, str, str]) -> AsyncIterator[list[Fake]]:
    """Fakes from (flavour, role, behaviours separated by commas)."""
    async with trio.open_nursery() as nursery:
        out = [await nursery.start(Fake(card(f, r), b.split(",")).run) for f, r, b in specs]
        yield out
        nursery.cancel_scope.cancel()


def urls(*servers: Fake | str) -> list[str]:
    return [s if isinstance(s, str) else s.url for s in servers]


async def run_flow(
    prefill: list[str], decode: list[str], request: Any = REQUEST, **kw: Any
) -> tuple[Any, list[Any]]:
    async with open_disagg(prefill, decode, describe_timeout=2, cancel_timeout=2) as pd:
        async with pd.generate(request, **kw) as flow:
            events = [e async for e in flow]
    return flow, events


async def test_context_first_relays_the_session_unchanged() -> None:
    with trio.fail_after(10):
        async with fakes(("vllm", "prefill", "prefill"), ("vllm", "decode", "decode")) as (p, d):
            meta = {"openengine-routing-key": "user-42"}
            flow, events = await run_flow(urls(p), urls(d), metadata=meta)
    assert flow.check().outcome == "completed" and flow.mode == "context_first"
    assert [e.response.token.text for e in events[:3]] == ["t", "t", "t"]
    assert events[-1].response.finished is not None
    [pre], [dec] = p.generates, d.generates
    assert pre.request.stopping.max_tokens == 1 and pre.kv_session_bytes is None
    assert dec.request.stopping.max_tokens == 3 and dec.kv_session_bytes == CONTEXT_SESSION
    assert pre.metadata == dec.metadata == meta
    assert flow.kv_session_bytes == CONTEXT_SESSION and flow.prefill_url == p.url + "/v1/ws"
    assert [e.response.prefill_ready is not None for e in flow.prefill_events] == [True]
    assert [(a.role, a.result) for a in flow.end.attempts] == [
        ("prefill", "completed"),
        ("decode", "completed"),
    ]


async def test_failover_skips_unreachable_and_retryable_sidecars() -> None:
    with trio.fail_after(10):
        async with fakes(
            ("vllm", "prefill", "overloaded"),
            ("vllm", "prefill", "prefill"),
            ("vllm", "decode", "overloaded"),
            ("vllm", "decode", "decode"),
        ) as (p_busy, p_ok, d_busy, d_ok):
            dead = closed_port_url()
            flow, _ = await run_flow(urls(dead, p_busy, p_ok), urls(d_busy, d_ok))
    assert flow.check().outcome == "completed", flow.end
    assert flow.prefill_url == p_ok.url + "/v1/ws" and flow.decode_url == d_ok.url + "/v1/ws"
    assert [(a.role, a.result, a.code) for a in flow.end.attempts] == [
        ("prefill", "unreachable", "ERROR_CODE_INTERNAL"),
        ("prefill", "rejected", "ERROR_CODE_OVERLOADED"),
        ("prefill", "completed", None),
        ("decode", "rejected", "ERROR_CODE_OVERLOADED"),
        ("decode", "completed", None),
    ]
    # the retried decode got the same, unpulled session
    assert [g.kv_session_bytes for g in d_busy.generates + d_ok.generates] == [CONTEXT_SESSION] * 2


async def test_a_fatal_prefill_rejection_ends_the_flow_before_the_decode() -> None:
    with trio.fail_after(10):
        async with fakes(
            ("vllm", "prefill", "invalid"), ("vllm", "prefill", "prefill"), ("vllm", "decode", "decode")
        ) as (p_bad, p_ok, d):
            flow, events = await run_flow(urls(p_bad, p_ok), urls(d))
    assert events == [] and flow.end.outcome == "rejected"
    assert flow.end.error.code == "ERROR_CODE_INVALID_ARGUMENT" and not flow.end.error.retryable
    assert p_ok.generates == [] and d.generates == []
    with pytest.raises(DisaggError) as info:
        flow.check()
    assert info.value.code == "ERROR_CODE_INVALID_ARGUMENT"


async def test_nothing_is_sent_when_no_pair_fits() -> None:
    with trio.fail_after(10):
        async with fakes(
            ("vllm", "prefill", "prefill"), ("trtllm", "decode", "decode"), ("vllm", "aggregated", "decode")
        ) as (p, d, agg):
            flow, _ = await run_flow(urls(p), urls(d))
            assert flow.end.outcome == "rejected" and flow.end.error.code == "ERROR_CODE_UNSUPPORTED_FEATURE"
            assert "handoff profiles differ" in flow.end.error.message
            flow, _ = await run_flow(urls(p), urls(agg))
            assert flow.end.error.code == "ERROR_CODE_ROLE_MISMATCH"
            audio = {**REQUEST, "media": [{"modality": "MODALITY_AUDIO", "url": "http://x/a.wav"}]}
            flow, _ = await run_flow(urls(p), urls(p), audio)
            assert flow.end.error.code == "ERROR_CODE_ROLE_MISMATCH"  # a prefill is no decode
    assert p.generates == d.generates == agg.generates == []


async def test_unreachable_everywhere_is_a_retryable_rejection() -> None:
    with trio.fail_after(10):
        flow, _ = await run_flow([closed_port_url()], [closed_port_url()])
    assert flow.end.outcome == "rejected" and flow.end.error.retryable
    assert "no decode sidecar" in flow.end.error.message


async def test_invalid_requests_reach_nobody() -> None:
    with trio.fail_after(10):
        async with fakes(("vllm", "prefill", "prefill"), ("vllm", "decode", "decode")) as (p, d):
            flow, _ = await run_flow(urls(p), urls(d), {"prompt": 7})
            assert flow.end.outcome == "rejected" and "request.prompt" in flow.end.error.message
            with_session = {**REQUEST, "kv": {"session": {"sessionId": "x"}}}
            flow, _ = await run_flow(urls(p), urls(d), with_session)
            assert flow.end.error.code == "ERROR_CODE_INVALID_ARGUMENT"
    assert p.generates == d.generates == []


async def test_bootstrap_sends_one_session_to_both_sides_at_once() -> None:
    with trio.fail_after(10):
        async with fakes(("sglang", "prefill", "prefill-echo"), ("sglang", "decode", "decode")) as (p, d):
            async with open_disagg(urls(p), urls(d)) as pd:
                async with pd.generate(REQUEST) as flow:
                    events = [e async for e in flow]
                    assert pd.rooms_in_flight == set()  # released once the flow ended
    assert flow.check().outcome == "completed" and flow.mode == "bootstrap" and len(events) == 4
    [pre], [dec] = p.generates, d.generates
    assert pre.kv_session_bytes == dec.kv_session_bytes == flow.kv_session_bytes
    assert pre.request.stopping.max_tokens == 3  # SGLang's prefill takes the request as is
    ref = pb.KvSessionRef.parse(pre.kv_session_bytes)
    assert ref.bootstrap is not None and str(ref.bootstrap.room_id) == flow.end.room
    assert (ref.bootstrap.endpoint.host, ref.bootstrap.endpoint.port) == ("10.0.0.5", 7000)


@pytest.mark.parametrize(
    ("prefills", "decode", "outcome", "code"),
    [
        (["prefill-wrong-room"], "decode", "completed", None),  # decode done first: see below
        (["invalid"], "hang", "rejected", "ERROR_CODE_INVALID_ARGUMENT"),
        (["prefill-wrong-room"], "hang", "failed", "ERROR_CODE_INTERNAL"),
        (["prefill-echo"], "invalid", "rejected", "ERROR_CODE_INVALID_ARGUMENT"),
    ],
)
async def test_bootstrap_cancels_the_other_side(
    prefills: list[str], decode: str, outcome: str, code: str | None
) -> None:
    with trio.fail_after(10):
        specs = [("sglang", "prefill", b) for b in prefills] + [("sglang", "decode", decode)]
        async with fakes(*specs) as servers:
            *ps, d = servers
            flow, _ = await run_flow(urls(*ps), urls(d))
    if decode == "decode":
        # the decode finished before the prefill's (wrong) echo arrived: the output stands
        assert flow.end.outcome == "completed"
        return
    assert flow.end.outcome == outcome and flow.end.error.code == code, flow.end
    if decode == "hang":
        assert len(d.cancels) == 1  # the decode was cancelled because of the prefill
    if decode == "invalid":
        assert len(ps[0].cancels) <= 1  # the prefill had ended already, or was cancelled


async def test_bootstrap_retries_both_sides_on_the_next_prefill_with_a_new_room() -> None:
    with trio.fail_after(10):
        async with fakes(
            ("sglang", "prefill", "overloaded"),
            ("sglang", "prefill", "prefill-echo"),
            ("sglang", "decode", "hang,decode"),
        ) as (p_busy, p_ok, d):
            p_busy.wait_for = d.started  # refuse only once the decode is waiting for its KV
            flow, _ = await run_flow(urls(p_busy, p_ok), urls(d))
    assert flow.check().outcome == "completed"
    first, second = (pb.KvSessionRef.parse(g.kv_session_bytes) for g in d.generates)
    assert first.bootstrap.room_id != second.bootstrap.room_id
    assert pb.KvSessionRef.parse(p_ok.generates[0].kv_session_bytes) == second
    assert len(d.cancels) == 1  # the first decode was cancelled when its prefill refused
    assert [(a.role, a.result) for a in flow.end.attempts] == [
        ("prefill", "rejected"),
        ("decode", "cancelled"),
        ("prefill", "completed"),
        ("decode", "completed"),
    ]


@pytest.mark.parametrize("flavor", ["vllm", "sglang"])
async def test_leaving_the_flow_cancels_both_sides(flavor: str) -> None:
    pre_behaviour = "prefill" if flavor == "vllm" else "prefill-echo"
    with trio.fail_after(10):
        async with fakes((flavor, "prefill", pre_behaviour), (flavor, "decode", "hang-tokens")) as (p, d):
            async with open_disagg(urls(p), urls(d), cancel_timeout=2) as pd:
                async with pd.generate(REQUEST) as flow:
                    async for _ in flow:
                        break
    assert flow.end.outcome == "cancelled" and flow.end.error.code == "ERROR_CODE_CANCELLED"
    assert len(d.cancels) == 1
    if flavor == "sglang":
        assert len(p.cancels) <= 1  # the echoing prefill may have completed before the cancel


async def test_a_lost_prefill_connection_fails_over() -> None:
    with trio.fail_after(10):
        async with fakes(
            ("vllm", "prefill", "die"), ("vllm", "prefill", "prefill"), ("vllm", "decode", "decode")
        ) as (p_die, p_ok, d):
            flow, _ = await run_flow(urls(p_die, p_ok), urls(d))
    assert flow.check().outcome == "completed"
    assert [a.result for a in flow.end.attempts][:2] == ["lost", "completed"]


async def test_command_json_lines_and_exit_status() -> None:
    with trio.fail_after(10):
        async with fakes(("vllm", "prefill", "prefill"), ("vllm", "decode", "decode")) as (p, d):
            out, err = io.StringIO(), io.StringIO()
            status = await run_disagg(
                [p.url], [d.url], "hello", max_tokens=3, as_json=True, out=out, err=err, handle_sigint=False
            )
            assert status == 0, err.getvalue()
            lines = [json.loads(line) for line in out.getvalue().splitlines()]
            assert [line.get("phase") for line in lines] == [
                "prefill",
                "decode",
                "decode",
                "decode",
                "decode",
                None,
            ]
            assert lines[0]["response"]["prefillReady"] and lines[0]["kvSessionBytes"]
            assert lines[-1]["type"] == "end" and lines[-1]["outcome"] == "completed"
            assert lines[-1]["mode"] == "context_first" and len(lines[-1]["attempts"]) == 2

            out, err = io.StringIO(), io.StringIO()
            status = await run_disagg([p.url], [d.url], "hello", out=out, err=err, handle_sigint=False)
            assert status == 0 and out.getvalue() == "ttt\n"

            out, err = io.StringIO(), io.StringIO()
            dead = closed_port_url()
            status = await run_disagg([dead], [d.url], "hello", out=out, err=err, handle_sigint=False)
            assert status == 1 and "unreachable" in err.getvalue() and "rejected:" in err.getvalue()


async def test_context_first_decode_that_cannot_get_the_kv_reruns_the_prefill_elsewhere() -> None:
    """The prefill completed, then its engine died: the decode's transfer fails. The flow runs
    the prefill again on the next prefill, then the same decode (and asks the first prefill to
    release the session, in case its engine still holds it)."""
    with trio.fail_after(10):
        async with fakes(
            ("vllm", "prefill", "prefill"),
            ("vllm", "prefill", "prefill"),
            ("vllm", "decode", "transfer-failed,decode"),
        ) as (p1, p2, d):
            flow, events = await run_flow(urls(p1, p2), urls(d))
    assert flow.check().outcome == "completed", flow.end
    assert flow.prefill_url == p2.url + "/v1/ws" and len(events) == 4
    assert [(a.role, a.url, a.result, a.code) for a in flow.end.attempts] == [
        ("prefill", p1.url + "/v1/ws", "completed", None),
        ("decode", d.url + "/v1/ws", "failed", "ERROR_CODE_KV_TRANSFER_FAILED"),
        ("prefill", p2.url + "/v1/ws", "completed", None),
        ("decode", d.url + "/v1/ws", "completed", None),
    ]


async def test_bootstrap_decode_failing_first_still_fails_over_to_the_next_prefill() -> None:
    """The race from a busy machine: the first prefill is refusing, but the decode's failed
    transfer from it arrives first. The next prefill serves (the decode was never at fault)."""
    with trio.fail_after(10):
        async with fakes(
            ("sglang", "prefill", "refuse-late"),
            ("sglang", "prefill", "prefill-echo"),
            ("sglang", "decode", "transfer-failed,decode"),
        ) as (p1, p2, d):
            flow, _ = await run_flow(urls(p1, p2), urls(d))
    assert flow.check().outcome == "completed", flow.end
    assert flow.prefill_url == p2.url + "/v1/ws" and flow.decode_url == d.url + "/v1/ws"
    assert [(a.role, a.result) for a in flow.end.attempts][:2] == [
        ("prefill", "cancelled"),
        ("decode", "failed"),
    ]
