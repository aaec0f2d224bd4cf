"""The suite checks every rule the sidecar fails an engine's stream for.

Each way the serving path can fail an engine's stream is a :class:`Violation`
(``sidecar.openengine.stream_rules``), used where it is raised or reported, and
``CONFORMANCE_CHECKS`` names the check that covers it. Asserted both ways here: every violation
has a check and every mapped check is in the suite; every violation is used where it is raised
(nothing in the table is dead, nothing raised is missing from it). Then, for each violation, a
fault switch of the simulated engine makes the serving path report exactly that violation, and
the covering check fail against an engine with the same fault — so no engine passes the suite
and then has its streams failed by the sidecar for a rule the suite does not check.
"""

from __future__ import annotations

import ast
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import trio

from sidecar.conformance.model import Status
from sidecar.conformance.runner import all_checks
from sidecar.core.lifecycle import FAILED, LifecycleConfig, Outcome, StreamSupervisor
from sidecar.kvbridge.decode_proto import batch_from_proto
from sidecar.kvbridge.errors import KvDecodeError
from sidecar.openengine import pb
from sidecar.openengine.client import EngineClient, open_engine_client
from sidecar.openengine.engine_errors import EngineTerminalError
from sidecar.openengine.stream_rules import CONFORMANCE_CHECKS, KvEventRules, StreamRuleError, Violation
from tests.mock_engines import run_mock_engine

from .helpers import explain, ids, mock, suite

ROOT = Path(__file__).resolve().parents[2]
#: Where the serving path raises or reports each violation.
RAISED_IN = ("sidecar/openengine/stream_rules.py", "sidecar/core/lifecycle.py", "sidecar/kvbridge/errors.py")


def test_every_violation_has_a_check_and_every_check_exists() -> None:
    assert set(CONFORMANCE_CHECKS) == set(Violation)
    suite_ids = {c.id for c in all_checks()}
    assert {v: c for v, c in CONFORMANCE_CHECKS.items() if c not in suite_ids} == {}
    err = StreamRuleError(Violation.REQUEST_ID, "engine sent request_id 'x' on the stream of 'y'")
    assert str(err).endswith("(conformance check generate.request-id)")  # the report names its check


def _violations_used(path: Path) -> set[Violation]:
    """``Violation.X`` references in ``path`` outside the table itself."""
    tree = ast.parse(path.read_text())
    table = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.AnnAssign | ast.Assign)
        and "CONFORMANCE_CHECKS"
        in ast.unparse(node.targets[0] if isinstance(node, ast.Assign) else node.target)
        for n in ast.walk(node)
    }
    return {
        Violation[node.attr]
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "Violation"
        and id(node) not in table
    }


def test_every_violation_is_used_where_it_is_raised() -> None:
    used = set().union(*(_violations_used(ROOT / p) for p in RAISED_IN))
    assert set(Violation) - used == set()


def test_stream_rules_raise_only_named_violations() -> None:
    """Every rule the checkers enforce raises a StreamRuleError with its Violation (an
    EngineTerminalError is the engine's own EngineError, not a broken rule)."""
    tree = ast.parse((ROOT / "sidecar/openengine/stream_rules.py").read_text())
    raised = [n.exc for n in ast.walk(tree) if isinstance(n, ast.Raise) and n.exc is not None]
    assert raised
    for exc in raised:
        assert isinstance(exc, ast.Call) and isinstance(exc.func, ast.Name), ast.unparse(exc)
        assert exc.func.id in ("StreamRuleError", "EngineTerminalError"), ast.unparse(exc)
        if exc.func.id == "StreamRuleError":
            first = exc.args[0]
            assert isinstance(first, ast.Attribute) and ast.unparse(first.value) == "Violation", ast.unparse(
                exc
            )


# -- each violation: the serving path reports it, the suite's covering check fails ------------------

Serve = Callable[[EngineClient, "Case"], Any]


@dataclass(frozen=True)
class Case:
    """An engine with ``faults`` and how the serving path meets it (``serve``)."""

    faults: tuple[str, ...]
    serve: str = "generate"  # generate | drain | kv | kv-rules
    flavor: str = "vllm"
    request: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    process: bool = False  # a real process (its crash loses the connection)


CASES: dict[Violation, Case] = {
    Violation.REQUEST_ID: Case(("wrong-request-id",)),
    Violation.NO_EVENT: Case(("empty-event",)),
    Violation.AFTER_TERMINAL: Case(("token-after-finish",)),
    Violation.AFTER_FINISH: Case(("token-after-finish",), request={"n": 2}),
    Violation.NO_OUTPUT_INDEX: Case(("no-output-index",), flavor="sglang"),
    Violation.OUTPUT_INDEX_RANGE: Case(("output-index-range",)),
    Violation.PROMPT_TWICE: Case(("prompt-twice",), request={"prompt_logprobs": True}),
    Violation.USAGE_NOT_FINAL: Case(("early-usage",), flavor="trtllm"),
    Violation.NO_TERMINAL: Case(("close-without-terminal",)),
    Violation.STATUS_AFTER_ACCEPTANCE: Case(("status-after=3",)),
    Violation.LOST_AFTER_ACCEPTANCE: Case(("crash-after=1",), process=True),
    Violation.UNREADABLE: Case(("undecodable-event",)),
    Violation.SILENT: Case(("hold-after-terminal",), config={"inactivity_timeout": 0.5}),
    Violation.DRAIN_AFTER_TERMINAL: Case(("drain-event-after-complete",), serve="drain"),
    Violation.DRAIN_NO_EVENT: Case(("drain-empty-event",), serve="drain", flavor="sglang"),
    Violation.DRAIN_NO_COMPLETE: Case(("drain-no-complete",), serve="drain", flavor="trtllm"),
    Violation.KV_NO_EVENT: Case(("kv-empty-response",), serve="kv", flavor="trtllm"),
    Violation.KV_UNDECODABLE: Case(("kv-undecodable",), serve="kv", flavor="trtllm"),
    # The client stops reading at a terminal EngineError, so this rule of KvEventRules is
    # shown on the raw stream it would see.
    Violation.KV_AFTER_ERROR: Case(("kv-event-after-error",), serve="kv-rules", flavor="trtllm"),
}


def test_every_violation_has_a_case() -> None:
    assert set(CASES) == set(Violation)


@asynccontextmanager
async def _engine(case: Case, tmp_path: Path) -> AsyncIterator[str]:
    if case.process:
        async with run_mock_engine(tmp_path, case.flavor, faults=case.faults, orphans="release") as proc:
            yield proc.address
    else:
        async with mock(case.flavor, "aggregated", case.faults) as engine:
            yield engine.address


def _request(case: Case) -> pb.GenerateRequest:
    n, logprobs = case.request.get("n"), case.request.get("prompt_logprobs", False)
    return pb.GenerateRequest(
        request_id="coverage-1",
        prompt="The quick brown fox",
        sampling=pb.SamplingParams(num_sequences=n) if n else None,
        stopping=pb.StoppingOptions(max_tokens=4),
        response=pb.ResponseOptions(return_prompt_logprobs=True) if logprobs else None,
    )


async def _serve_generate(client: EngineClient, case: Case) -> Violation | None:
    """The sidecar's relay (``StreamSupervisor``) serving one request: the violation it reports."""
    supervisor = StreamSupervisor(client, LifecycleConfig(abort_timeout=1.0, **case.config))
    handle = supervisor.admit(_request(case))
    relayed: list[pb.GenerateResponse] = []

    async def emit(event: pb.GenerateResponse) -> None:
        relayed.append(event)

    outcome: Outcome = await supervisor.run(handle, emit)
    assert outcome.kind == FAILED, (outcome, relayed)
    return outcome.violation


async def _serve_drain(client: EngineClient, case: Case) -> Violation | None:
    """A checked Drain (the sidecar's own drain reads it so): the violation it raises."""
    try:
        async with client.drain(pb.DrainRequest(stop_accepting_new_requests=False)) as stream:
            async for _ in stream:
                pass
    except StreamRuleError as err:
        return err.violation
    return None


async def _store(client: EngineClient) -> None:
    """Make the engine publish a KV batch (one prefilled request)."""
    request = pb.GenerateRequest(
        request_id="coverage-store", prompt="x " * 40, stopping=pb.StoppingOptions(max_tokens=1)
    )
    async with client.generate(request) as stream:
        async for _ in stream:
            pass


async def _serve_kv(client: EngineClient, case: Case) -> Violation | None:
    """A checked KV subscription whose batches go through the KV bridge's decoder (as its
    gRPC ingest takes them): the violation raised."""
    try:
        async with client.subscribe_kv_events(pb.SubscribeKvEventsRequest(data_parallel_ranks=[0])) as stream:
            await _store(client)
            async for resp in stream:
                if resp.batch is not None:
                    batch_from_proto(resp.batch)
                    await _store(client)
    except StreamRuleError as err:
        return err.violation
    except KvDecodeError as err:
        return err.violation
    return None


async def _kv_rules(client: EngineClient, case: Case) -> Violation | None:
    """KvEventRules over the raw stream of a snapshot subscription."""
    rules = KvEventRules()
    request = pb.SubscribeKvEventsRequest(data_parallel_ranks=[0], include_snapshot=True)
    async with client.subscribe_kv_events(request, checked=False) as stream:
        async for resp in stream:
            try:
                rules.observe(resp)
            except EngineTerminalError:
                continue
            except StreamRuleError as err:
                return err.violation
    return None


SERVE: dict[str, Callable[[EngineClient, Case], Any]] = {
    "generate": _serve_generate,
    "drain": _serve_drain,
    "kv": _serve_kv,
    "kv-rules": _kv_rules,
}


@pytest.mark.parametrize("violation", list(CASES), ids=[v.value for v in CASES])
async def test_the_sidecar_reports_it_and_the_suite_fails_it(
    aio_loop: Any, tmp_path: Path, violation: Violation
) -> None:
    case = CASES[violation]
    async with _engine(case, tmp_path) as address, open_engine_client(address) as client:
        with trio.fail_after(20):
            reported = await SERVE[case.serve](client, case)
    assert reported is violation
    async with _engine(case, tmp_path) as address:
        report = await suite(engine=address, only=(violation.check,))
    assert ids(report, Status.FAIL) == [violation.check], explain(report)


async def test_an_oversized_event_is_the_wire_formats_finding(aio_loop: Any) -> None:
    """Over the default 4 MiB bound: the sidecar's UNREADABLE, and not a lost connection to
    the suite (no other generate check fails for it)."""
    async with mock("trtllm", "aggregated", ("oversized-event",)) as engine:
        report = await suite(engine=engine.address, only=("generate",))
    assert ids(report, Status.FAIL) == ["generate.wire-format"], explain(report)
    assert "exceeds the limit of 4194304 bytes" in report.results[-1].reason
