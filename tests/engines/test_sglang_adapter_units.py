"""I/O-free parts of the SGLang adapter that need no SGLang: cumulative chunks into deltas by the
stream rules, the request mapping onto SGLang's fields, rids no other rid starts with, the command's
answer when the 'sglang' extra is missing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from sidecar.engines.common.checks import ModelLimits
from sidecar.engines.sglang import command
from sidecar.engines.sglang.events import ChunkEvents, EngineRefusal
from sidecar.engines.sglang.requests import plan_request, sglang_rid
from sidecar.openengine import pb
from sidecar.openengine.serving.grpc_server import RpcStatusError

LIMITS = ModelLimits(
    names=("m",),
    vocab_size=100,
    max_model_len=64,
    max_num_sequences=4,
    max_logprobs=5,
    priority=False,
    guided_backend="xgrammar",
)


def chunk(ids: list[int], text: str, reason: dict[str, Any] | None = None, **meta: Any) -> dict[str, Any]:
    return {
        "output_ids": ids,
        "text": text,
        "meta_info": {"prompt_tokens": 3, "cached_tokens": 0, "finish_reason": reason, **meta},
    }


def test_cumulative_chunks_become_deltas_with_one_finish() -> None:
    b = ChunkEvents("r", 1, eos_token_id=2, stop_token_ids=frozenset({7}))
    events = b.on_chunk(chunk([5], "a"))
    events += b.on_chunk(chunk([5, 6], "ab"))
    events += b.on_chunk(chunk([5, 6, 7], "abc", {"type": "stop", "matched": 7}))
    assert [len(e.token.tokens) for e in events if e.token is not None] == [1, 1, 1]
    assert "".join(e.token.text for e in events if e.token is not None) == "abc"
    last = events[-1]
    assert last.finished.reason == pb.FinishReason.STOP
    assert last.finished.stop_match == pb.StopMatch(stop_token_id=7)
    assert last.usage == pb.Usage(
        prompt_tokens=3, completion_tokens=3, total_tokens=6, cached_prompt_tokens=0
    )
    eos = ChunkEvents("r", 1, eos_token_id=2).on_chunk(chunk([2], "", {"type": "stop", "matched": 2}))
    assert eos[-1].finished.stop_match == pb.StopMatch(eos_token_id=2)
    text = ChunkEvents("r", 1, eos_token_id=2).on_chunk(chunk([4], "x", {"type": "stop", "matched": "END"}))
    assert text[-1].finished.stop_match == pb.StopMatch(stop_text="END")


def test_abort_is_cancelled_and_an_early_4xx_abort_is_a_refusal() -> None:
    b = ChunkEvents("r", 1, eos_token_id=None)
    b.on_chunk(chunk([1], "a"))
    (tok, fin) = b.on_chunk(chunk([1, 3], "ab", {"type": "abort", "message": "Aborted"}))
    assert tok.token.tokens[0].token_id == 3 and fin.finished.reason == pb.FinishReason.CANCELLED
    with pytest.raises(EngineRefusal):
        ChunkEvents("r", 1, eos_token_id=None).on_chunk(
            chunk([], "", {"type": "abort", "message": "bad grammar", "status_code": 400})
        )


def test_parallel_samples_by_index_and_logprob_candidates() -> None:
    b = ChunkEvents("r", 2, eos_token_id=None, output_logprobs=True, top_n=1)
    lp = {
        "output_token_logprobs": [(-0.5, 9, None)],
        "output_top_logprobs": [[(-0.1, 8, None), (-0.5, 9, None)]],
    }
    events = b.on_chunk({"index": 1, **chunk([9], "q", None, **lp)})
    (token,) = events[0].token.tokens
    assert events[0].token.output_index == 1 and token.logprob == -0.5 and token.rank is None
    assert [c.token_id for c in token.candidates] == [8]
    b.on_chunk({"index": 1, **chunk([9], "q", {"type": "length"})})
    assert not b.done
    (last,) = b.on_chunk({"index": 0, **chunk([], "", {"type": "length"})})
    assert b.done and last.usage is not None and last.usage.completion_tokens == 1


def test_requests_map_onto_sglang_fields() -> None:
    req = pb.GenerateRequest(
        request_id="a",
        token_ids=pb.TokenIds(ids=[1, 2, 3]),
        sampling=pb.SamplingParams(temperature=0.5, seed=7, num_sequences=2),
        stopping=pb.StoppingOptions(
            max_tokens=4,
            include_stop_in_output=True,
            conditions=[pb.StopCondition(stop_text="x"), pb.StopCondition(stop_token_id=5)],
        ),
        guided=pb.GuidedDecoding(regex="[ab]+"),
    )
    plan = plan_request(req, [], LIMITS)
    assert plan.kwargs["input_ids"] == [1, 2, 3] and plan.num_outputs == 2
    assert plan.kwargs["sampling_params"] == {
        "temperature": 0.5,
        "sampling_seed": 7,
        "n": 2,
        "max_new_tokens": 4,
        "no_stop_trim": True,
        "stop": ["x"],
        "stop_token_ids": [5],
        "regex": "[ab]+",
    }
    assert plan.rids == [f"{sglang_rid('a')}_0", f"{sglang_rid('a')}_1"]
    choice = pb.GenerateRequest(
        request_id="b", prompt="p", guided=pb.GuidedDecoding(choice=pb.ChoiceConstraint(choices=["x"]))
    )
    with pytest.raises(RpcStatusError) as err:
        plan_request(choice, [], LIMITS)
    assert err.value.status == "UNIMPLEMENTED"


def test_stop_token_ids_with_ignore_eos_are_refused_unless_eos() -> None:
    """SGLang's ignore_eos turns its stop token check off: it would generate past them."""

    def req(*ids: int) -> pb.GenerateRequest:
        conditions = [pb.StopCondition(stop_token_id=i) for i in ids]
        stopping = pb.StoppingOptions(max_tokens=4, ignore_eos=True, conditions=conditions)
        return pb.GenerateRequest(request_id="s", prompt="p", stopping=stopping)

    with pytest.raises(RpcStatusError) as err:
        plan_request(req(5), [], LIMITS, frozenset({2}))
    assert err.value.status == "UNIMPLEMENTED"
    assert plan_request(req(2), [], LIMITS, frozenset({2})).kwargs["sampling_params"]["ignore_eos"] is True


@pytest.mark.parametrize(("a", "b"), [("req-1", "req-10"), ("a", "a_0"), ("x_1", "x"), ("1:a", "a")])
def test_no_rid_starts_with_another(a: str, b: str) -> None:
    """SGLang's scheduler aborts every rid that starts with the one it is given."""
    ra, rb = sglang_rid(a), sglang_rid(b)
    for x, y in ((ra, rb), (rb, ra)):
        assert not (y.startswith(x) or f"{y}_0".startswith(x) or f"{y}_0".startswith(f"{x}_1"))


def test_command_without_the_extra_exits_1_with_the_reason(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    (tmp_path / "config.json").write_text("{}")  # a model directory: the extra is what is missing
    result = CliRunner().invoke(command.sglang_engine, ["--model", str(tmp_path)])
    assert result.exit_code == 1 and command.EXTRA_MISSING in result.output


def test_model_directory_needs_a_config(tmp_path: Path) -> None:
    result = CliRunner().invoke(command.sglang_engine, ["--model", str(tmp_path), "--listen", "127.0.0.1:1"])
    assert result.exit_code in (1, 2)
    assert "has no config.json" in result.output or command.EXTRA_MISSING in result.output
