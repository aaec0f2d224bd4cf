"""Seeded generation, stop rules and log-probabilities (I/O-free)."""

from __future__ import annotations

import itertools

import pytest

from sidecar.mock import generator as gen
from sidecar.mock import tokenizer as tok

PROMPT = [tok.BOS_ID, *tok.encode(" the quick brown fox")]


def run(seq: gen.OutputSequence, limit: int = 10_000) -> list[gen.Step]:
    steps = []
    while not seq.finished and len(steps) < limit:
        steps.append(seq.next_step())
    return steps


def sequence(rules: gen.StopRules, seed: int | None = None, **kw: object) -> gen.OutputSequence:
    base = gen.request_seed(PROMPT) if seed is None else seed
    return gen.OutputSequence(seed=base, rules=rules, **kw)  # type: ignore[arg-type]


def test_same_request_same_tokens() -> None:
    a = [s.token_id for s in run(sequence(gen.StopRules(max_tokens=100)))]
    b = [s.token_id for s in run(sequence(gen.StopRules(max_tokens=100)))]
    assert a == b and len(a) > 1


def test_seed_and_prompt_and_lora_change_the_output() -> None:
    base = gen.request_seed(PROMPT)
    assert gen.request_seed(PROMPT, seed=1) != base
    assert gen.request_seed(PROMPT[:-1]) != base
    assert gen.request_seed(PROMPT, lora_name="x") != base
    assert gen.output_seed(base, 1, greedy=False) != gen.output_seed(base, 0, greedy=False)
    assert gen.output_seed(base, 1, greedy=True) == base


def test_natural_eos_ends_with_stop_and_counts_the_eos() -> None:
    seq = sequence(gen.StopRules(max_tokens=1000))
    steps = run(seq)
    last = steps[-1]
    assert last.token_id == tok.EOS_ID
    assert last.finish == gen.Finish("stop", eos_token_id=tok.EOS_ID)
    assert last.text == ""
    assert len(steps) == seq.natural_length + 1
    assert 16 <= seq.natural_length < 64


def test_max_tokens_gives_length() -> None:
    steps = run(sequence(gen.StopRules(max_tokens=3)))
    assert len(steps) == 3
    assert steps[-1].finish == gen.Finish("length")
    assert [s.finish for s in steps[:-1]] == [None, None]


def test_ignore_eos_runs_to_max_tokens() -> None:
    steps = run(sequence(gen.StopRules(max_tokens=200, ignore_eos=True)))
    assert len(steps) == 200
    assert tok.EOS_ID not in [s.token_id for s in steps]
    assert steps[-1].finish == gen.Finish("length")


def test_min_tokens_delays_eos() -> None:
    seq = sequence(gen.StopRules(max_tokens=1000, min_tokens=100))
    steps = run(seq)
    assert len(steps) == 101
    assert steps[-1].token_id == tok.EOS_ID


def _reference_text() -> str:
    return "".join(s.text for s in run(sequence(gen.StopRules(max_tokens=1000))))


def test_stop_text_is_cut_and_reported() -> None:
    text = _reference_text()
    stop = text[10:14]
    steps = run(sequence(gen.StopRules(max_tokens=1000, stop_texts=(stop,))))
    out = "".join(s.text for s in steps)
    assert out == text[: text.index(stop)]
    assert steps[-1].finish == gen.Finish("stop", stop_text=stop)


def test_stop_text_included_when_asked() -> None:
    text = _reference_text()
    stop = text[10:14]
    steps = run(sequence(gen.StopRules(max_tokens=1000, stop_texts=(stop,), include_stop_in_output=True)))
    assert "".join(s.text for s in steps) == text[: text.index(stop) + len(stop)]


def test_earliest_stop_wins_and_text_is_held_back() -> None:
    checker = gen.StopChecker(gen.StopRules(max_tokens=100, stop_texts=("be", "ba be")))
    delta, finish = checker.feed(tok.word_id(0))  # " ba": "ba" could start "ba be", held back
    assert (delta, finish) == (" ", None)
    delta, finish = checker.feed(tok.word_id(1))  # " be": both match, "ba be" starts first
    assert finish == gen.Finish("stop", stop_text="ba be")
    assert delta == ""
    assert checker.text == " "


def test_stop_token_id() -> None:
    ref = run(sequence(gen.StopRules(max_tokens=1000)))
    target = ref[5].token_id
    first = next(i for i, s in enumerate(ref) if s.token_id == target)
    steps = run(sequence(gen.StopRules(max_tokens=1000, stop_token_ids=frozenset({target}))))
    assert len(steps) == first + 1
    assert steps[-1].finish == gen.Finish("stop", stop_token_id=target)
    assert steps[-1].text == ""
    included = run(
        sequence(
            gen.StopRules(max_tokens=1000, stop_token_ids=frozenset({target}), include_stop_in_output=True)
        )
    )
    assert included[-1].text == tok.token_text(target)


def test_stop_token_never_before_min_tokens() -> None:
    ref = run(sequence(gen.StopRules(max_tokens=1000)))
    target = ref[0].token_id
    steps = run(sequence(gen.StopRules(max_tokens=30, min_tokens=10, stop_token_ids=frozenset({target}))))
    assert target not in [s.token_id for s in steps[:10]]


def test_stop_match_at_max_tokens_wins_over_length() -> None:
    ref = run(sequence(gen.StopRules(max_tokens=1000)))
    steps = run(sequence(gen.StopRules(max_tokens=4, stop_token_ids=frozenset({ref[3].token_id}))))
    if ref[3].token_id not in {s.token_id for s in ref[:3]}:
        assert steps[-1].finish == gen.Finish("stop", stop_token_id=ref[3].token_id)


def test_forced_choice_then_eos() -> None:
    forced = gen.choice_tokens(["yes", "no"], 1)
    steps = run(sequence(gen.StopRules(max_tokens=100), forced=forced))
    assert "".join(s.text for s in steps) == "no"
    assert steps[-1].token_id == tok.EOS_ID


def test_feed_after_finish_is_an_error() -> None:
    checker = gen.StopChecker(gen.StopRules(max_tokens=1))
    checker.feed(tok.word_id(3))
    with pytest.raises(RuntimeError):
        checker.feed(tok.word_id(3))


def test_logprobs_top_n_and_token_ids() -> None:
    seq = sequence(gen.StopRules(max_tokens=20), with_logprobs=True, logprobs=gen.CandidateSpec(top_n=5))
    for step in run(seq):
        assert step.score is not None
        cands = step.score.candidates
        assert [c.rank for c in cands] == [1, 2, 3, 4, 5]
        assert all(a.logprob > b.logprob for a, b in itertools.pairwise(cands))
        assert 1 <= step.score.rank <= 3
        if step.score.rank <= 5:
            assert cands[step.score.rank - 1].token_id == step.token_id
    ids = (tok.word_id(0), tok.EOS_ID)
    seq = sequence(gen.StopRules(max_tokens=3), with_logprobs=True, logprobs=gen.CandidateSpec(token_ids=ids))
    for step in run(seq):
        assert step.score is not None
        assert [c.token_id for c in step.score.candidates] == list(ids)


def test_greedy_picks_rank_one() -> None:
    seq = sequence(gen.StopRules(max_tokens=10), greedy=True, with_logprobs=True)
    assert all(s.score is not None and s.score.rank == 1 for s in run(seq))


def test_probabilities_sum_below_one() -> None:
    import math

    ranked = gen.ranked_candidates(12345, tok.word_id(7), 2)
    assert len(ranked) == gen.TOP_CANDIDATES
    assert sum(math.exp(c.logprob) for c in ranked) < 1.0
    assert ranked[1].token_id == tok.word_id(7)


def test_prompt_scores() -> None:
    scores = gen.prompt_scores(PROMPT, 0, gen.CandidateSpec(top_n=2))
    assert [t for t, _ in scores] == PROMPT
    assert scores[0][1] is None
    assert all(s is not None and len(s.candidates) == 2 for _, s in scores[1:])
    assert gen.prompt_scores(PROMPT, 3, None)[0][0] == PROMPT[3]
