"""The stream rules one by one, on hand-made records (I/O-free)."""

from __future__ import annotations

from sidecar.conformance import streams as rules
from sidecar.conformance.streams import StreamRecord
from sidecar.openengine import pb

RID = "r"


def req(
    n: int | None = None, max_tokens: int | None = 4, stop_ids: tuple[int, ...] = ()
) -> pb.GenerateRequest:
    r = pb.GenerateRequest(request_id=RID, prompt="p")
    if n is not None:
        r.sampling = pb.SamplingParams(num_sequences=n)
    r.stopping = pb.StoppingOptions(
        max_tokens=max_tokens, conditions=[pb.StopCondition(stop_token_id=t) for t in stop_ids]
    )
    return r


def tok(index: int | None = 0, count: int = 1, usage: bool = False) -> pb.GenerateResponse:
    ev = pb.GenerateResponse(
        request_id=RID,
        token=pb.TokenOutput(output_index=index, tokens=[pb.TokenInfo(token_id=9)] * count),
    )
    if usage:
        ev.usage = pb.Usage(completion_tokens=1)
    return ev


def fin(
    index: int | None = 0,
    reason: pb.FinishReason = pb.FinishReason.LENGTH,
    usage: bool = False,
    match: pb.StopMatch | None = None,
    completion: int = 1,
) -> pb.GenerateResponse:
    ev = pb.GenerateResponse(
        request_id=RID, finished=pb.GenerationFinished(output_index=index, reason=reason, stop_match=match)
    )
    if usage:
        ev.usage = pb.Usage(completion_tokens=completion)
    return ev


def err(usage: bool = True) -> pb.GenerateResponse:
    return pb.GenerateResponse(
        request_id=RID,
        error=pb.EngineError(code=pb.ErrorCode.INTERNAL),
        usage=pb.Usage() if usage else None,
    )


def prompt() -> pb.GenerateResponse:
    return pb.GenerateResponse(request_id=RID, prompt=pb.PromptOutput(tokens=[pb.TokenInfo(token_id=1)]))


def ready(usage: bool = True) -> pb.GenerateResponse:
    return pb.GenerateResponse(
        request_id=RID,
        prefill_ready=pb.PrefillReady(kv_session=pb.KvSessionRef(session_id="s")),
        usage=pb.Usage() if usage else None,
    )


def rec(request: pb.GenerateRequest, *events: pb.GenerateResponse, end: str = "ok") -> StreamRecord:
    return StreamRecord("t", request, list(events), end=end)


GOOD = rec(req(), tok(), tok(), fin(usage=True, completion=2))
GOOD2 = rec(req(n=2), tok(0), tok(1), fin(0), tok(1), fin(1, usage=True, completion=3))


def test_good_streams_break_no_rule() -> None:
    for r in (GOOD, GOOD2):
        assert rules.output_index_violations(r) == []
        assert rules.finish_count_violations(r) == []
        assert rules.after_finish_violations(r) == []
        assert rules.after_error_violations(r) == []
        assert rules.usage_violations(r) == []
        assert rules.prompt_once_violations(r) == []
        assert rules.stop_match_violations(r) == []
        assert rules.max_tokens_violations(r) == []
        assert rules.request_id_violations(r) == []
        assert rules.event_violations(r) == []
        assert rules.close_violations(r) == []
        assert rules.wire_violations(r) == []
    assert rules.terminal_position(GOOD2) == 4


def test_output_index() -> None:
    assert rules.output_index_violations(rec(req(), tok(None), fin(usage=True)))
    assert rules.output_index_violations(rec(req(), tok(), fin(None, usage=True)))
    assert rules.output_index_violations(rec(req(), tok(1), fin(usage=True)))  # only one output
    assert rules.output_index_violations(rec(req(n=2), tok(1), fin(0), fin(1, usage=True))) == []


def test_finish_count() -> None:
    missing = rec(req(n=2), tok(0), tok(1), fin(1, usage=True))
    assert "output 0 has no GenerationFinished" in rules.finish_count_violations(missing)[0]
    twice = rec(req(), tok(), fin(), fin(usage=True))
    assert "2 GenerationFinished" in rules.finish_count_violations(twice)[0]
    # a failed stream or one we left need not finish every output
    assert rules.finish_count_violations(rec(req(n=2), tok(0), err())) == []
    assert rules.finish_count_violations(rec(req(), tok(), end="left")) == []
    # prefill: exactly one PrefillReady, no finishes
    assert rules.finish_count_violations(rec(req(), ready()), prefill=True) == []
    assert rules.finish_count_violations(rec(req(), ready(), ready()), prefill=True)
    assert rules.finish_count_violations(rec(req(), prompt()), prefill=True)
    assert rules.finish_count_violations(rec(req(), fin(usage=True)), prefill=True)


def test_after_finish() -> None:
    late_token = rec(req(n=2), tok(0), fin(0), tok(0), tok(1), fin(1, usage=True))
    assert "a token for output 0 after its GenerationFinished" in rules.after_finish_violations(late_token)[0]
    after_terminal = rec(req(), tok(), fin(usage=True), prompt())
    assert "after the stream's terminal" in rules.after_finish_violations(after_terminal)[0]
    # an event after EngineError is the after-error rule's business, not this one's
    assert rules.after_finish_violations(rec(req(), tok(), err(), tok())) == []


def test_after_error() -> None:
    assert rules.after_error_violations(rec(req(), tok(), err())) == []
    assert "sent after EngineError" in rules.after_error_violations(rec(req(), err(), tok()))[0]
    closed_badly = rec(req(), err(), end="status")
    closed_badly.status = "INTERNAL"
    assert "must close OK" in rules.after_error_violations(closed_badly)[0]


def test_usage() -> None:
    assert "no Usage" in rules.usage_violations(rec(req(), tok(), fin()))[0]
    assert "non-final" in rules.usage_violations(rec(req(), tok(usage=True), fin(usage=True)))[0]
    assert "non-final" in rules.usage_violations(rec(req(n=2), fin(0, usage=True), fin(1, usage=True)))[0]
    assert rules.usage_violations(rec(req(), ready())) == []
    assert rules.usage_violations(rec(req(), ready(usage=False)))
    assert rules.usage_violations(rec(req(), tok(), err())) == []
    assert rules.usage_violations(rec(req(), tok(), err(usage=False)))
    # a token after the terminal carries none: the terminal is still the final response
    assert rules.usage_violations(rec(req(), fin(usage=True), tok())) == []
    # no terminal (a missing finish): the last event may carry Usage, no earlier one
    assert rules.usage_violations(rec(req(n=2), tok(0), fin(1, usage=True))) == []


def test_prompt_once() -> None:
    assert rules.prompt_once_violations(rec(req(), prompt(), tok(), fin(usage=True))) == []
    assert rules.prompt_once_violations(rec(req(), prompt(), prompt(), tok(), fin(usage=True)))


def test_stop_match() -> None:
    stop = pb.FinishReason.STOP
    assert rules.stop_match_violations(rec(req(), fin(reason=stop, usage=True)))
    eos = pb.StopMatch(eos_token_id=2)
    assert rules.stop_match_violations(rec(req(), fin(reason=stop, match=eos, usage=True))) == []
    asked = rec(req(stop_ids=(5,)), fin(reason=stop, match=pb.StopMatch(stop_token_id=5), usage=True))
    assert rules.stop_match_violations(asked) == []
    other = rec(req(stop_ids=(5,)), fin(reason=stop, match=pb.StopMatch(stop_token_id=6), usage=True))
    assert "not one the request asked for" in rules.stop_match_violations(other)[0]
    text = rec(req(), fin(reason=stop, match=pb.StopMatch(stop_text="x"), usage=True))
    assert rules.stop_match_violations(text)


def test_max_tokens() -> None:
    assert (
        rules.max_tokens_violations(rec(req(max_tokens=2), tok(count=2), fin(usage=True, completion=2))) == []
    )
    over = rec(req(max_tokens=2), tok(), tok(), tok(), fin(usage=True, completion=3))
    problems = rules.max_tokens_violations(over)
    assert any("generated 3 tokens" in p for p in problems)
    assert any("completion_tokens 3" in p for p in problems)
    # tokens after the finish are the after-finish rule's concern
    assert rules.max_tokens_violations(rec(req(max_tokens=1), tok(), fin(usage=True), tok())) == []
    assert rules.tokens_per_output(rec(req(), tok(None, count=2))) == {0: 2}


def test_request_id() -> None:
    other = tok()
    other.request_id = "someone-else"
    found = rules.request_id_violations(rec(req(), tok(), other, fin(usage=True)))
    assert found == ["stream 't', event #2 (token): request_id 'someone-else' on the stream of 'r'"]
    unnamed = tok()
    unnamed.request_id = ""
    assert rules.request_id_violations(rec(req(), unnamed, fin(usage=True))) == []  # empty: allowed


def test_one_event() -> None:
    empty = pb.GenerateResponse(request_id=RID)
    assert rules.event_violations(rec(req(), tok(), empty, fin(usage=True))) == [
        "stream 't', event #2 (no event): a GenerateResponse with no event"
    ]


def test_closes_ok() -> None:
    status = rec(req(), tok(), end="status")
    status.status, status.status_message = "INTERNAL", "boom"
    assert "ended with status INTERNAL (boom) after 1 event(s)" in rules.close_violations(status)[0]
    after_terminal = rec(req(), tok(), fin(usage=True), end="status")
    assert rules.close_violations(after_terminal)  # a status even after the terminal
    lost = rec(req(), tok(), fin(usage=True), end="transport")
    assert "lost after its terminal event (#2)" in rules.close_violations(lost)[0]
    assert rules.close_violations(rec(req(), tok(), end="transport")) == []  # lost_violations' own
    held = rec(req(), tok(), fin(usage=True), end="timeout")
    held.gave_up = "not closed within 3 s of its terminal event"
    assert (
        "stayed open after its terminal event (#2): not closed within 3 s" in rules.close_violations(held)[0]
    )
    silent = rec(req(), end="timeout")
    silent.gave_up = "did not end within 20 s"
    assert rules.close_violations(silent) == ["stream 't': did not end within 20 s (0 event(s), no terminal)"]
    aborted = rec(req(), tok(), end="timeout")
    aborted.aborted = True  # ending an aborted stream is the cancellation checks' rule
    assert rules.close_violations(aborted) == []
    # not this rule's: a failed stream (after_error_violations), one we left, a refusal
    assert rules.close_violations(rec(req(), tok(), err(), end="status")) == []
    assert rules.close_violations(rec(req(), tok(), end="left")) == []
    assert rules.close_violations(rec(req(), end="status")) == []


def test_wire_format() -> None:
    broken = rec(req(), tok(), end="protocol")
    broken.error = "Generate: engine sent something undecodable (UnicodeDecodeError: ...)"
    assert rules.wire_violations(broken) == [
        "stream 't': after 1 event(s): Generate: engine sent something undecodable (UnicodeDecodeError: ...)"
    ]
    assert rules.close_violations(broken) == []  # the wire rule's alone
