"""The stream checkers name each broken rule (I/O-free): every Violation they raise, on hand-made streams."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from sidecar.openengine import pb
from sidecar.openengine.engine_errors import (
    EngineMessageTooLarge,
    EngineProtocolError,
    EngineStatusError,
    EngineTerminalError,
    EngineUnavailable,
)
from sidecar.openengine.stream_rules import (
    DrainRules,
    GenerateRules,
    KvEventRules,
    StreamRuleError,
    Violation,
    violation_of,
)

RID = "r"


def tok(index: int | None = 0, rid: str = RID, usage: bool = False) -> pb.GenerateResponse:
    return pb.GenerateResponse(
        request_id=rid, token=pb.TokenOutput(output_index=index), usage=pb.Usage() if usage else None
    )


def fin(index: int | None = 0, usage: bool = True) -> pb.GenerateResponse:
    return pb.GenerateResponse(
        request_id=RID,
        finished=pb.GenerationFinished(output_index=index, reason=pb.FinishReason.LENGTH),
        usage=pb.Usage() if usage else None,
    )


PROMPT = pb.GenerateResponse(request_id=RID, prompt=pb.PromptOutput())
ERROR = pb.GenerateResponse(request_id=RID, error=pb.EngineError(code=pb.ErrorCode.INTERNAL))


def _broken(rules: Any, events: Sequence[Any], *, end: bool = True) -> Violation | None:
    """The Violation ``rules`` raise over ``events`` (then the OK close, when ``end``)."""
    try:
        for event in events:
            rules.observe(event)
        if end:
            rules.check_end()
    except StreamRuleError as err:
        assert isinstance(err, EngineProtocolError)
        assert str(err).endswith(f"(conformance check {err.violation.check})")
        return err.violation
    return None


@pytest.mark.parametrize(
    ("n", "events", "violation"),
    [
        (1, [tok(), fin()], None),
        (2, [tok(0), tok(1), fin(0, usage=False), fin(1)], None),
        (1, [tok(rid="other")], Violation.REQUEST_ID),
        (1, [pb.GenerateResponse(request_id=RID)], Violation.NO_EVENT),
        (1, [tok(), fin(), tok()], Violation.AFTER_TERMINAL),
        (2, [tok(0), fin(0, usage=False), tok(0)], Violation.AFTER_FINISH),
        (1, [tok(None)], Violation.NO_OUTPUT_INDEX),
        (1, [tok(), fin(None)], Violation.NO_OUTPUT_INDEX),
        (1, [tok(1)], Violation.OUTPUT_INDEX_RANGE),
        (1, [PROMPT, PROMPT], Violation.PROMPT_TWICE),
        (1, [tok(usage=True)], Violation.USAGE_NOT_FINAL),
        (1, [tok()], Violation.NO_TERMINAL),
    ],
)
def test_generate_rules(n: int, events: list[pb.GenerateResponse], violation: Violation | None) -> None:
    assert _broken(GenerateRules(RID, n), events) is violation


def test_an_engine_error_is_no_violation() -> None:
    rules = GenerateRules(RID, 1)
    rules.observe(tok())
    with pytest.raises(EngineTerminalError):
        rules.observe(ERROR)
    assert rules.terminal


def _drain(state: pb.DrainState | None) -> pb.DrainResponse:
    return pb.DrainResponse() if state is None else pb.DrainResponse(state=state)


@pytest.mark.parametrize(
    ("states", "violation"),
    [
        ([pb.DrainState.STARTED, pb.DrainState.COMPLETE], None),
        (
            [pb.DrainState.STARTED, pb.DrainState.COMPLETE, pb.DrainState.IN_PROGRESS],
            Violation.DRAIN_AFTER_TERMINAL,
        ),
        ([pb.DrainState.STARTED, None], Violation.DRAIN_NO_EVENT),
        ([pb.DrainState.STARTED], Violation.DRAIN_NO_COMPLETE),
    ],
)
def test_drain_rules(states: list[pb.DrainState | None], violation: Violation | None) -> None:
    assert _broken(DrainRules(), [_drain(s) for s in states]) is violation


def test_kv_event_rules() -> None:
    batch = pb.SubscribeKvEventsResponse(batch=pb.KvEventBatch(sequence_number=0))
    assert _broken(KvEventRules(), [batch, batch]) is None  # it may end OK at any time
    assert _broken(KvEventRules(), [pb.SubscribeKvEventsResponse()]) is Violation.KV_NO_EVENT
    rules = KvEventRules()
    with pytest.raises(EngineTerminalError):
        rules.observe(pb.SubscribeKvEventsResponse(error=pb.EngineError(code=pb.ErrorCode.INTERNAL)))
    assert _broken(rules, [batch], end=False) is Violation.KV_AFTER_ERROR


def test_violation_of_a_failed_accepted_stream() -> None:
    rule = StreamRuleError(Violation.PROMPT_TWICE, "engine sent PromptOutput twice")
    assert violation_of(rule) is Violation.PROMPT_TWICE
    assert violation_of(EngineMessageTooLarge(5 << 20, 4 << 20)) is Violation.UNREADABLE
    assert (
        violation_of(EngineProtocolError("Generate: engine sent something undecodable"))
        is Violation.UNREADABLE
    )
    status = EngineStatusError("INTERNAL", 13, "boom", pb.ErrorCode.INTERNAL)
    assert violation_of(status) is Violation.STATUS_AFTER_ACCEPTANCE
    assert violation_of(EngineUnavailable("connection lost")) is Violation.LOST_AFTER_ACCEPTANCE
    terminal = EngineTerminalError(pb.EngineError(code=pb.ErrorCode.INTERNAL), ERROR)
    assert violation_of(terminal) is None  # the engine's own verdict
