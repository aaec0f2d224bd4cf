"""Seeded, deterministic token generation for the simulated engines (I/O-free).

Same request → same tokens, on every run and platform: randomness is a SplitMix64
hash of (seed, output, step), never Python's ``random``.

- The request seed mixes the prompt ids, the LoRA name and ``SamplingParams.seed``
  (absent seed = 0). Output ``i`` uses ``mix(seed, i)``; with an explicit
  ``temperature == 0`` (greedy) every output uses output 0's stream.
- Each output has a natural length ``16 + mix(seed, "eos") % 48`` tokens after which
  it emits EOS (unless ``ignore_eos``; never before ``min_tokens`` tokens).
- Tokens are drawn from 400 working words (word ``(k * 1619) % N_WORDS`` for
  ``k < 400``, with a leading space), with ``.`` and ``,`` one time in 16 each, so
  output reads like `` bako tu rive, ...``; ``forced`` tokens (guided choice) come first.
- Log-probabilities: 20 ranked candidates per position with strictly decreasing
  logprobs whose probabilities sum below 1; the sampled token is rank 1 when greedy,
  else rank 1 to 3.

Stopping follows vLLM's rules (see :class:`StopChecker`).
"""

from __future__ import annotations

import codecs
import hashlib
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from sidecar.mock import tokenizer as tok

MASK64 = (1 << 64) - 1
TOP_CANDIDATES = 20
VOCAB_WORDS = 400
_WORD_STRIDE = 1619  # prime, coprime with N_WORDS: the 400 working words spread over all of them
_EOS_TAG = 0xE05
_PROMPT_TAG = 0x9207


def splitmix64(x: int) -> int:
    """One SplitMix64 output for state ``x`` (64-bit)."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    z = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def mix(*values: int) -> int:
    """A 64-bit hash of a tuple of integers (each taken modulo 2^64)."""
    h = 0x6A09E667F3BCC908
    for v in values:
        h = splitmix64(h ^ (v & MASK64))
    return h


def hash_ids(ids: Sequence[int]) -> int:
    """64-bit hash of a token-id sequence (BLAKE2b of the uint32 array)."""
    return int.from_bytes(hashlib.blake2b(array("I", ids).tobytes(), digest_size=8).digest(), "little")


def hash_text(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def request_seed(prompt_ids: Sequence[int], seed: int | None = None, lora_name: str = "") -> int:
    """The seed every output of a request derives from."""
    return mix(hash_ids(prompt_ids), hash_text(lora_name), 0 if seed is None else seed + 1)


def output_seed(base: int, index: int, greedy: bool) -> int:
    return base if greedy else mix(base, index)


def working_word(k: int) -> int:
    """Token id of working word ``k`` (0 ≤ k < VOCAB_WORDS), leading space included."""
    return tok.word_id((k * _WORD_STRIDE) % tok.N_WORDS)


# --- log-probabilities ------------------------------------------------------------


@dataclass(frozen=True)
class Candidate:
    token_id: int
    logprob: float
    rank: int


@dataclass(frozen=True)
class CandidateSpec:
    """Which candidates to report per position: ``top_n`` or explicit ``token_ids``."""

    top_n: int | None = None
    token_ids: tuple[int, ...] = ()

    def select(self, ranked: Sequence[Candidate], position_seed: int) -> list[Candidate]:
        if self.top_n is not None:
            return list(ranked[: self.top_n])
        if not self.token_ids:
            return []
        by_id = {c.token_id: c for c in ranked}
        floor = ranked[-1].logprob
        out = []
        for tid in self.token_ids:
            c = by_id.get(tid)
            if c is None:
                h = mix(position_seed, tid)
                c = Candidate(tid, floor - 1.0 - (h % 1000) / 100.0, TOP_CANDIDATES + 1 + (h >> 16) % 10000)
            out.append(c)
        return out


def ranked_candidates(position_seed: int, actual: int, actual_rank: int) -> list[Candidate]:
    """20 candidates in rank order, ``actual`` at ``actual_rank`` (1-based)."""
    ids: list[int] = []
    seen = {actual}
    k = 0
    while len(ids) < TOP_CANDIDATES - 1:
        wid = working_word((mix(position_seed, 0xCA, k) >> 8) % VOCAB_WORDS)
        k += 1
        if wid not in seen:
            seen.add(wid)
            ids.append(wid)
    ids.insert(actual_rank - 1, actual)
    out = []
    lp = -(0.3 + 0.6 * ((mix(position_seed, 0x10) >> 11) / 2**53))
    for rank, tid in enumerate(ids, start=1):
        if rank > 1:
            lp -= 2.0 + (mix(position_seed, 0x11, rank) >> 11) / 2**53
        out.append(Candidate(tid, lp, rank))
    return out


@dataclass(frozen=True)
class TokenScore:
    """Logprob, rank and selected candidates of one token position."""

    logprob: float
    rank: int
    candidates: tuple[Candidate, ...]


def score_position(
    position_seed: int, actual: int, actual_rank: int, spec: CandidateSpec | None
) -> TokenScore:
    ranked = ranked_candidates(position_seed, actual, actual_rank)
    me = ranked[actual_rank - 1]
    chosen = tuple(spec.select(ranked, position_seed)) if spec is not None else ()
    return TokenScore(me.logprob, me.rank, chosen)


def prompt_scores(
    prompt_ids: Sequence[int], start: int, spec: CandidateSpec | None
) -> list[tuple[int, TokenScore | None]]:
    """(token id, score) for prompt positions ``start`` … end; position 0 has no score."""
    base = mix(hash_ids(prompt_ids), _PROMPT_TAG)
    out: list[tuple[int, TokenScore | None]] = []
    for pos in range(start, len(prompt_ids)):
        tid = prompt_ids[pos]
        if pos == 0:
            out.append((tid, None))
            continue
        seed = mix(base, pos)
        out.append((tid, score_position(seed, tid, 1 + seed % 5, spec)))
    return out


# --- stopping -----------------------------------------------------------------------


@dataclass(frozen=True)
class StopRules:
    """Stopping options of one request, already defaulted and validated."""

    max_tokens: int
    min_tokens: int = 0
    stop_texts: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    include_stop_in_output: bool = False


@dataclass(frozen=True)
class Finish:
    """Why an output finished: ``reason`` is ``"stop"`` or ``"length"``."""

    reason: str
    stop_token_id: int | None = None
    stop_text: str | None = None
    eos_token_id: int | None = None


class StopChecker:
    """Applies :class:`StopRules` to one output's tokens and yields its text deltas.

    vLLM's rules: EOS and stop token ids end the output only after ``min_tokens``
    tokens precede them (the generator never produces them earlier); stop strings
    are searched once at least ``min_tokens`` tokens exist, only in text that includes
    the newest token; the matched stop (and anything after it) is cut from the text
    unless ``include_stop_in_output``; text that could be the start of a stop string is
    held back until resolved. A stop match on the ``max_tokens``-th token wins over
    ``length``. Every token counts toward ``max_tokens`` and usage, EOS included.
    """

    def __init__(self, rules: StopRules) -> None:
        self.rules = rules
        self.count = 0
        self._text = ""
        self._emitted = 0
        self._max_stop = max((len(s) for s in rules.stop_texts), default=0)
        self._bytes = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending_bytes = False
        self.finish: Finish | None = None

    def _piece(self, token_id: int) -> str:
        """Detokenized text of one more token (byte tokens join into UTF-8 characters)."""
        if tok.BYTE_BASE <= token_id < tok.PUNCT_BASE:
            self._pending_bytes = True
            return str(self._bytes.decode(bytes([token_id - tok.BYTE_BASE])))
        if not self._pending_bytes:
            return tok.output_text(token_id)
        self._pending_bytes = False
        head = str(self._bytes.decode(b"", final=True))
        self._bytes.reset()
        return head + tok.output_text(token_id)

    @property
    def text(self) -> str:
        """The output text emitted so far."""
        return self._text[: self._emitted]

    def stop_allowed(self) -> bool:
        """May the next token be EOS or a stop token id (``min_tokens`` satisfied)?"""
        return self.count >= self.rules.min_tokens

    def feed(self, token_id: int) -> tuple[str, Finish | None]:
        """Account one generated token; returns (new text, finish or None)."""
        if self.finish is not None:
            raise RuntimeError("output already finished")
        rules = self.rules
        allowed = self.stop_allowed()
        self.count += 1
        if token_id == tok.EOS_ID and allowed and not rules.ignore_eos:
            return self._end(Finish("stop", eos_token_id=token_id))
        piece = self._piece(token_id)
        if token_id in rules.stop_token_ids and allowed:
            if rules.include_stop_in_output:
                self._text += piece
            return self._end(Finish("stop", stop_token_id=token_id))
        before = len(self._text)
        self._text += piece
        if rules.stop_texts and self.count >= rules.min_tokens:
            best: tuple[int, str] | None = None
            for s in rules.stop_texts:
                pos = self._text.find(s, max(0, before - len(s) + 1))
                if pos >= 0 and (best is None or pos < best[0]):
                    best = (pos, s)
            if best is not None:
                pos, s = best
                self._text = self._text[: pos + (len(s) if rules.include_stop_in_output else 0)]
                return self._end(Finish("stop", stop_text=s))
        if self.count >= rules.max_tokens:
            return self._end(Finish("length"))
        hold = self._held_back()
        upto = max(self._emitted, len(self._text) - hold)
        delta = self._text[self._emitted : upto]
        self._emitted = upto
        return delta, None

    def _held_back(self) -> int:
        if not self._max_stop:
            return 0
        text = self._text
        for k in range(min(self._max_stop - 1, len(text)), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self.rules.stop_texts):
                return k
        return 0

    def _end(self, finish: Finish) -> tuple[str, Finish]:
        delta = self._text[self._emitted :]
        self._emitted = len(self._text)
        self.finish = finish
        return delta, finish


# --- generation ---------------------------------------------------------------------


@dataclass
class Step:
    """One generated token of one output, ready to become a ``TokenOutput``."""

    token_id: int
    text: str
    score: TokenScore | None
    finish: Finish | None


@dataclass
class OutputSequence:
    """The token stream of one output index.

    ``forced`` ids are emitted first (guided choice / JSON object); once they run
    out the output ends with EOS when allowed. ``logprobs`` None means no scores.
    """

    seed: int
    rules: StopRules
    greedy: bool = False
    logprobs: CandidateSpec | None = None
    with_logprobs: bool = False
    forced: tuple[int, ...] = ()
    checker: StopChecker = field(init=False)
    step_index: int = field(init=False, default=0)
    natural_length: int = field(init=False)

    def __post_init__(self) -> None:
        self.checker = StopChecker(self.rules)
        self.natural_length = 16 + mix(self.seed, _EOS_TAG) % 48

    @property
    def finished(self) -> bool:
        return self.checker.finish is not None

    def _pick(self, t: int) -> int:
        allowed = self.checker.stop_allowed()
        if t < len(self.forced):
            return self.forced[t]
        if self.forced:
            if allowed and not self.rules.ignore_eos:
                return tok.EOS_ID
        elif t >= self.natural_length and allowed and not self.rules.ignore_eos:
            return tok.EOS_ID
        attempt = 0
        while True:
            r = mix(self.seed, t, attempt)
            bucket = r % 16
            if bucket == 0:
                tid = tok.PUNCT_BASE + tok.PUNCT.index(".")
            elif bucket == 1:
                tid = tok.PUNCT_BASE + tok.PUNCT.index(",")
            else:
                tid = working_word((r >> 8) % VOCAB_WORDS)
            if allowed or tid not in self.rules.stop_token_ids:
                return tid
            attempt += 1

    def next_step(self) -> Step:
        """Generate the next token. Raises RuntimeError once finished."""
        t = self.step_index
        tid = self._pick(t)
        self.step_index += 1
        score = None
        if self.with_logprobs:
            pseed = mix(self.seed, t, 0x5C0)
            rank = 1 if self.greedy or t < len(self.forced) else 1 + pseed % 3
            score = score_position(pseed, tid, rank, self.logprobs)
        text, finish = self.checker.feed(tid)
        return Step(tid, text, score, finish)


def choice_tokens(choices: Iterable[str], seed: int) -> tuple[int, ...]:
    """Guided ``choice``: the ids of one choice picked by ``seed``."""
    options = list(choices)
    if not options:
        return ()
    return tuple(tok.encode(options[seed % len(options)]))
