"""vLLM's streamed ``RequestOutput`` deltas → OpenEngine ``GenerateResponse`` events, by the stream rules.

One :class:`EventBuilder` per request. Rules it keeps (schema "Generation API"): every
``TokenOutput`` and ``GenerationFinished`` carries ``output_index``; exactly one
``GenerationFinished`` per output, and nothing for an index after it; ``PromptOutput`` at most
once, first; ``Usage`` on the final event only (the last ``GenerationFinished``, or the one
terminal ``EngineError``). vLLM's finish reasons map to ``STOP`` (with the ``stop_match``:
stop token, stop text or EOS), ``LENGTH`` and ``CANCELLED`` (``abort``); ``error`` becomes a
terminal ``EngineError{INTERNAL, retryable}``. I/O-free (duck-typed on vLLM's output objects).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sidecar.engines.common.events import EngineFailure, StreamEvents
from sidecar.openengine import pb

__all__ = ["EngineFailure", "EventBuilder", "token_info"]

_REASONS = {
    "stop": pb.FinishReason.STOP,
    "length": pb.FinishReason.LENGTH,
    "abort": pb.FinishReason.CANCELLED,
}


def _logprob_entries(entry: Any) -> Mapping[int, Any]:
    """One position's ``{token id: Logprob}`` (vLLM's dict, or a flat row)."""
    return entry if isinstance(entry, Mapping) else {}


def token_info(
    token_id: int, entry: Any, top_n: int | None, ids: frozenset[int] = frozenset()
) -> pb.TokenInfo:
    """The ``TokenInfo`` of ``token_id`` at one position, with its candidates when logprobs were asked."""
    entries = _logprob_entries(entry)
    chosen = entries.get(token_id)
    info = pb.TokenInfo(token_id=token_id)
    if chosen is None:
        return info
    info.logprob = float(chosen.logprob)
    info.rank = chosen.rank
    info.token = chosen.decoded_token or ""
    if top_n is None:
        return info
    candidates = [
        (tid, lp) for tid, lp in entries.items() if (lp.rank is not None and lp.rank <= top_n) or tid in ids
    ]
    candidates.sort(key=lambda c: (c[1].rank if c[1].rank is not None else 1 << 30, c[0]))
    info.candidates = [
        pb.LogProb(token_id=tid, logprob=float(lp.logprob), token=lp.decoded_token or "", rank=lp.rank)
        for tid, lp in candidates
    ]
    return info


class EventBuilder(StreamEvents):
    """Turns one request's vLLM outputs into events (the stream rules are :class:`StreamEvents`')."""

    def __init__(
        self,
        request_id: str,
        num_outputs: int,
        *,
        eos_token_id: int | None,
        prompt_logprobs: bool = False,
        prompt_logprob_start: int = 0,
        output_logprobs: bool = False,
        top_n: int = 0,
        candidate_ids: frozenset[int] = frozenset(),
    ) -> None:
        super().__init__(request_id, num_outputs, eos_token_id=eos_token_id)
        self.want_prompt = prompt_logprobs
        self.prompt_start = prompt_logprob_start
        self.top_n = top_n if output_logprobs else None
        self.output_logprobs = output_logprobs
        self.candidate_ids = candidate_ids

    def _prompt_event(self, out: Any) -> pb.GenerateResponse | None:
        self.prompt_sent = True
        ids = list(out.prompt_token_ids or ())
        scores = list(out.prompt_logprobs or ())
        tokens = []
        for pos in range(self.prompt_start, len(ids)):
            entry = scores[pos] if pos < len(scores) else None
            tokens.append(token_info(ids[pos], entry, None))
        return self.event(prompt=pb.PromptOutput(tokens=tokens))

    def _stop_match(self, completion: Any) -> pb.StopMatch | None:
        reason = completion.stop_reason
        if isinstance(reason, str):
            return pb.StopMatch(stop_text=reason)
        if isinstance(reason, int):
            return pb.StopMatch(stop_token_id=reason)
        if self.eos_token_id is not None:
            return pb.StopMatch(eos_token_id=self.eos_token_id)
        return None

    def on_output(self, out: Any) -> list[pb.GenerateResponse]:
        """The events of one ``RequestOutput`` delta (possibly none).

        Raises :class:`EngineFailure` for vLLM's ``error`` finish (the caller sends :meth:`error`).
        """
        events: list[pb.GenerateResponse] = []
        if out.prompt_token_ids is not None:
            self.prompt_tokens = len(out.prompt_token_ids)
        if out.num_cached_tokens is not None:
            self.cached_tokens = out.num_cached_tokens
        if self.want_prompt and not self.prompt_sent and out.prompt_logprobs is not None:
            prompt_event = self._prompt_event(out)
            if prompt_event is not None:
                events.append(prompt_event)
        for completion in out.outputs:
            index = completion.index
            if index in self.finished or not 0 <= index < self.num_outputs:
                continue
            ids = list(completion.token_ids)
            if ids:
                entries = list(completion.logprobs or ()) if self.output_logprobs else []
                tokens = [
                    token_info(tid, entries[k] if k < len(entries) else None, self.top_n, self.candidate_ids)
                    for k, tid in enumerate(ids)
                ]
                events.append(self.tokens(index, tokens, completion.text))
            reason = completion.finish_reason
            if reason is None:
                continue
            if reason == "error":
                raise EngineFailure(f"vLLM failed output {index}")
            code = _REASONS.get(reason, pb.FinishReason.STOP)
            match = self._stop_match(completion) if code == pb.FinishReason.STOP else None
            message = "" if reason in _REASONS else f"vLLM finish reason {reason!r}"
            if code == pb.FinishReason.CANCELLED:
                message = "aborted"
            events.append(self.finish(index, code, message, match))
        return events
