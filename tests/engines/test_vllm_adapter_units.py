"""I/O-free parts of the vLLM adapter that need no vLLM: the event builder's stream rules, the
load the registry reports, the command's flag checks and its answer when the 'vllm' extra is
missing, the settings."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import pytest
from click.testing import CliRunner

from sidecar.engines.vllm import command
from sidecar.engines.vllm.config import VllmSettings
from sidecar.engines.vllm.engine import SchedulerStatsSink, VllmEngine
from sidecar.engines.vllm.events import EngineFailure, EventBuilder
from sidecar.openengine import pb


@dataclass
class Lp:
    logprob: float
    rank: int | None
    decoded_token: str | None = None


@dataclass
class Completion:
    index: int
    token_ids: list[int]
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, Lp]] | None = None


@dataclass
class Output:
    outputs: list[Completion]
    finished: bool = False
    prompt_token_ids: list[int] | None = field(default_factory=lambda: [1, 2, 3])
    prompt_logprobs: list[dict[int, Lp] | None] | None = None
    num_cached_tokens: int | None = 0


def kinds(events: list[pb.GenerateResponse]) -> list[str]:
    return [
        next(k for k in ("prompt", "token", "finished", "error") if getattr(e, k) is not None) for e in events
    ]


def test_two_outputs_one_finish_each_usage_on_the_last() -> None:
    b = EventBuilder("r", 2, eos_token_id=9)
    events = b.on_output(Output([Completion(0, [5], "a"), Completion(1, [6], "b")]))
    events += b.on_output(Output([Completion(0, [7], "c", finish_reason="length")]))
    events += b.on_output(Output([Completion(1, [8], "d", finish_reason="stop")], finished=True))
    assert kinds(events) == ["token", "token", "token", "finished", "token", "finished"]
    assert [e.token.output_index for e in events if e.token is not None] == [0, 1, 0, 1]
    f0, f1 = (e.finished for e in events if e.finished is not None)
    assert f0.output_index == 0 and f0.reason == pb.FinishReason.LENGTH and f0.stop_match is None
    assert (
        f1.output_index == 1
        and f1.reason == pb.FinishReason.STOP
        and f1.stop_match == pb.StopMatch(eos_token_id=9)
    )
    assert [e.usage is not None for e in events] == [False] * 5 + [True]
    assert events[-1].usage == pb.Usage(
        prompt_tokens=3, completion_tokens=4, total_tokens=7, cached_prompt_tokens=0
    )
    assert b.done and b.on_output(Output([Completion(0, [1], "late")])) == []  # nothing after a finish


def test_stop_matches_and_abort() -> None:
    b = EventBuilder("r", 1, eos_token_id=2)
    (_tok, fin) = b.on_output(Output([Completion(0, [4], "x", "stop", stop_reason="END")], finished=True))
    assert fin.finished.stop_match == pb.StopMatch(stop_text="END") and fin.usage is not None
    b = EventBuilder("r", 1, eos_token_id=2)
    (_, fin) = b.on_output(Output([Completion(0, [4], "x", "stop", stop_reason=17)], finished=True))
    assert fin.finished.stop_match == pb.StopMatch(stop_token_id=17)
    b = EventBuilder("r", 1, eos_token_id=2)
    (fin,) = b.on_output(Output([Completion(0, [], "", "abort")], finished=True))
    assert fin.finished.reason == pb.FinishReason.CANCELLED and fin.usage is not None
    b = EventBuilder("r", 2, eos_token_id=2)
    b.on_output(Output([Completion(0, [3], "y", "length")]))
    (rest,) = b.cancel_rest("aborted (abort)")
    assert rest.finished.output_index == 1 and rest.finished.reason == pb.FinishReason.CANCELLED
    assert rest.usage is not None and b.done
    with pytest.raises(EngineFailure):
        EventBuilder("r", 1, eos_token_id=2).on_output(Output([Completion(0, [3], "z", "error")]))
    err = EventBuilder("r", 1, eos_token_id=2).error(pb.ErrorCode.INTERNAL, "boom", retryable=True)
    assert err.error is not None and err.usage is not None


def test_withdrawn_events_are_as_if_never_built() -> None:
    b = EventBuilder("r", 1, eos_token_id=None)
    sent = b.on_output(Output([Completion(0, [5, 6])]))
    unsent = b.on_output(Output([Completion(0, [7, 8, 9], finish_reason="length")], finished=True))
    assert b.done
    b.withdraw(unsent)  # an Abort came before these were sent
    assert not b.done
    (cancel,) = b.cancel_rest("aborted (abort)")
    assert cancel.finished is not None and cancel.finished.reason == pb.FinishReason.CANCELLED
    assert kinds(sent) == ["token"] and cancel.usage is not None and cancel.usage.completion_tokens == 2


@pytest.mark.parametrize(
    ("in_flight", "vllm_running", "vllm_waiting", "expected"),
    [
        (0, 1, 0, (0, 0)),  # vLLM's stats from before its last request ended (no step since)
        (1, 0, 0, (1, 0)),  # admitted, vLLM has not stepped yet; or finished in vLLM, events unsent
        (3, 1, 2, (1, 2)),
        (1, 0, 5, (0, 1)),
    ],
)
def test_load_counts_the_registry_split_by_vllm_stats(
    in_flight: int, vllm_running: int, vllm_waiting: int, expected: tuple[int, int]
) -> None:
    stats = SchedulerStatsSink()
    stats.running, stats.waiting = vllm_running, vllm_waiting
    engine = VllmEngine(llm=None, discovery=cast(Any, None), stats=stats)
    engine.requests = {f"r{i}": cast(Any, None) for i in range(in_flight)}
    assert engine.requests_load() == expected


def test_prompt_once_first_and_candidates_by_rank() -> None:
    b = EventBuilder(
        "r", 1, eos_token_id=None, prompt_logprobs=True, prompt_logprob_start=1, output_logprobs=True, top_n=1
    )
    prompt_lps: list[dict[int, Lp] | None] = [None, {2: Lp(-0.5, 3, "b")}, {3: Lp(-0.1, 1, "c")}]
    lps = [{7: Lp(-0.2, 2, "g"), 8: Lp(-0.1, 1, "h"), 9: Lp(-3.0, 5, "i")}]
    events = b.on_output(Output([Completion(0, [7], "g", logprobs=lps)], prompt_logprobs=prompt_lps))
    events += b.on_output(
        Output(
            [Completion(0, [8], "h", "length", logprobs=[{8: Lp(-0.1, 1, "h")}])], prompt_logprobs=prompt_lps
        )
    )
    assert kinds(events) == ["prompt", "token", "token", "finished"]
    assert [t.token_id for t in events[0].prompt.tokens] == [2, 3] and events[0].prompt.tokens[0].rank == 3
    token = events[1].token.tokens[0]
    assert token.logprob == -0.2 and token.rank == 2 and token.token == "g"
    assert [c.token_id for c in token.candidates] == [8]  # top 1 by rank (the chosen token ranks 2nd)
    assert events[-1].finished.stop_match is None


def test_command_without_the_extra_exits_1_with_the_reason(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    (tmp_path / "config.json").write_text("{}")  # a model directory: the extra is what is missing
    result = CliRunner().invoke(command.vllm_engine, ["--model", str(tmp_path)])
    assert result.exit_code == 1 and command.EXTRA_MISSING in result.output


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--block-size", "48"], "not a multiple of 32"),
        (["--listen", "nowhere"], "expected HOST:PORT"),
        (["--kv-port", "70000"], "70000"),
    ],
)
def test_flags_are_checked_at_parse_time(tmp_path: Path, args: list[str], needle: str) -> None:
    result = CliRunner().invoke(command.vllm_engine, ["--model", str(tmp_path), *args])
    assert result.exit_code == 2 and needle in result.output, result.output


def test_model_directory_needs_a_config(tmp_path: Path) -> None:
    result = CliRunner().invoke(command.vllm_engine, ["--model", str(tmp_path)])
    assert result.exit_code == 2 and "has no config.json" in result.output


@pytest.mark.parametrize(
    ("listen", "kv_host", "advertised"),
    [
        ("127.0.0.1:50051", "", "127.0.0.1"),
        ("10.1.2.3:50051", "", "10.1.2.3"),
        ("0.0.0.0:50051", "", "127.0.0.1"),
        ("unix:///tmp/e.sock", "", "127.0.0.1"),
        ("0.0.0.0:50051", "engine-7.example", "engine-7.example"),
    ],
)
def test_the_kv_publisher_is_advertised_at_a_routable_host(
    listen: str, kv_host: str, advertised: str
) -> None:
    settings: Any = VllmSettings(model="/m", listen=listen, kv_host=kv_host)
    assert settings.advertised_kv_host() == advertised


def test_serve_argv_is_vllm_serve_on_the_adapter_settings() -> None:
    """``serve_argv``: stock ``vllm serve`` with the settings ``vllm-engine`` runs the engine
    with (only the ones given, plus its own defaults: eager, logprobs, seed)."""
    from sidecar.engines.vllm.config import VllmSettings, serve_argv

    settings = VllmSettings(
        model="/m", served_model_names=("a", "b"), dtype="float32", block_size=32, max_model_len=8192
    )
    assert serve_argv(settings, "py", 8000) == [
        "py", "-m", "vllm.entrypoints.openai.api_server", "--model", "/m",
        "--served-model-name", "a", "b", "--dtype", "float32", "--block-size", "32",
        "--max-model-len", "8192", "--enforce-eager", "--max-logprobs", "20", "--seed", "0",
        "--host", "127.0.0.1", "--port", "8000",
    ]  # fmt: skip
    plain = serve_argv(VllmSettings(model="/m", enforce_eager=False, prefix_caching=False), "py", 1)
    assert "--enforce-eager" not in plain and "--no-enable-prefix-caching" in plain
