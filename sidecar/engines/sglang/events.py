"""SGLang's streamed chunks → OpenEngine ``GenerateResponse`` events, by the stream rules.

One :class:`ChunkEvents` per request (the stream rules are
:class:`~sidecar.engines.common.events.StreamEvents`'). SGLang streams, per output (its
``index`` when ``n`` > 1), dicts whose ``output_ids``, ``text`` and logprob lists are
*cumulative*: each chunk is turned into the delta since the last one. Finish reasons map to
``STOP`` (``matched`` a stop text, a requested stop token, else the EOS token), ``LENGTH``, and
``CANCELLED`` (``abort``); an abort SGLang made itself with an HTTP-style 4xx status before any
token (a request it refused after admission, e.g. a grammar it cannot compile) raises
:class:`EngineRefusal`. I/O-free, SGLang-free (plain dicts).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sidecar.engines.common.events import StreamEvents
from sidecar.openengine import pb


class EngineRefusal(Exception):
    """SGLang refused an accepted request before its first token (``status`` is its HTTP status)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def _entry(row: Any) -> tuple[float | None, int, str]:
    """One SGLang logprob entry ``(logprob, token id, text or None)``."""
    logprob, token_id, text = row[0], row[1], row[2] if len(row) > 2 else None
    return (None if logprob is None else float(logprob)), int(token_id), text or ""


def token_info(
    token_id: int, chosen: Any, top: Sequence[Any] | None, top_n: int, extra: Sequence[Any] | None = None
) -> pb.TokenInfo:
    """The ``TokenInfo`` of one position: its logprob, rank (its place among the top
    candidates, when it is one) and candidates (the top ``top_n``, then asked token ids)."""
    info = pb.TokenInfo(token_id=token_id)
    if chosen is not None:
        logprob, _, text = _entry(chosen)
        if logprob is not None:
            info.logprob = logprob
        info.token = text
    ranked = [_entry(row) for row in (top or ())[:top_n]]
    for rank, (_, tid, _) in enumerate(ranked, 1):
        if tid == token_id:
            info.rank = rank
            break
    candidates = [
        pb.LogProb(token_id=tid, logprob=lp or 0.0, token=text, rank=rank)
        for rank, (lp, tid, text) in enumerate(ranked, 1)
    ]
    seen = {c.token_id for c in candidates}
    for row in extra or ():
        lp, tid, text = _entry(row)
        if tid not in seen:
            candidates.append(pb.LogProb(token_id=tid, logprob=lp or 0.0, token=text))
    if top_n or extra:
        info.candidates = candidates
    return info


class ChunkEvents(StreamEvents):
    """Turns one request's SGLang chunks into events."""

    def __init__(
        self,
        request_id: str,
        num_outputs: int,
        *,
        eos_token_id: int | None,
        stop_token_ids: frozenset[int] = frozenset(),
        prompt_logprobs: bool = False,
        prompt_top_n: int = 0,
        output_logprobs: bool = False,
        top_n: int = 0,
    ) -> None:
        super().__init__(request_id, num_outputs, eos_token_id=eos_token_id)
        self.stop_token_ids = stop_token_ids
        self.want_prompt = prompt_logprobs
        self.prompt_top_n = prompt_top_n
        self.output_logprobs = output_logprobs
        self.top_n = top_n
        self.sent_ids = [0] * num_outputs
        self.sent_text = [0] * num_outputs

    def _prompt_event(self, meta: dict[str, Any]) -> pb.GenerateResponse:
        self.prompt_sent = True
        rows = meta.get("input_token_logprobs") or []
        tops = meta.get("input_top_logprobs") or []
        tokens = [
            token_info(_entry(row)[1], row, tops[k] if k < len(tops) else None, self.prompt_top_n)
            for k, row in enumerate(rows)
        ]
        return self.event(prompt=pb.PromptOutput(tokens=tokens))

    def _stop_match(self, matched: Any) -> pb.StopMatch | None:
        if isinstance(matched, list):
            matched = matched[0] if matched else None
        if isinstance(matched, str):
            return pb.StopMatch(stop_text=matched)
        if isinstance(matched, int) and matched in self.stop_token_ids:
            return pb.StopMatch(stop_token_id=matched)
        if isinstance(matched, int):
            return pb.StopMatch(eos_token_id=matched)
        if self.eos_token_id is not None:
            return pb.StopMatch(eos_token_id=self.eos_token_id)
        return None

    def on_chunk(self, chunk: dict[str, Any]) -> list[pb.GenerateResponse]:
        """The events of one chunk (possibly none); raises :class:`EngineRefusal` (see the module doc)."""
        events: list[pb.GenerateResponse] = []
        index = int(chunk.get("index") or 0)
        meta: dict[str, Any] = chunk.get("meta_info") or {}
        if index in self.finished or not 0 <= index < self.num_outputs:
            return events
        if meta.get("prompt_tokens") is not None:
            self.prompt_tokens = int(meta["prompt_tokens"])
        if meta.get("cached_tokens") is not None:
            self.cached_tokens = int(meta["cached_tokens"])
        reason = meta.get("finish_reason") or None
        ids = list(chunk.get("output_ids") or ())
        new = ids[self.sent_ids[index] :]
        if (
            reason is not None
            and reason.get("type") == "abort"
            and isinstance(reason.get("status_code"), int)
            and 400 <= reason["status_code"] < 500
            and not self.completion_tokens[index]
            and not new
        ):
            raise EngineRefusal(str(reason.get("message") or "refused"), reason["status_code"])
        if self.want_prompt and not self.prompt_sent and meta.get("input_token_logprobs") is not None:
            events.append(self._prompt_event(meta))
        if new:
            start = self.sent_ids[index]
            rows = list(meta.get("output_token_logprobs") or ()) if self.output_logprobs else []
            tops = list(meta.get("output_top_logprobs") or ()) if self.output_logprobs else []
            extra = list(meta.get("output_token_ids_logprobs") or ()) if self.output_logprobs else []
            tokens = []
            for k, tid in enumerate(new, start):
                if not self.output_logprobs:
                    tokens.append(pb.TokenInfo(token_id=tid))
                    continue
                tokens.append(
                    token_info(
                        tid,
                        rows[k] if k < len(rows) else None,
                        tops[k] if k < len(tops) else None,
                        self.top_n,
                        extra[k] if k < len(extra) else None,
                    )
                )
            text = str(chunk.get("text") or "")
            delta, self.sent_text[index] = text[self.sent_text[index] :], len(text)
            self.sent_ids[index] = len(ids)
            events.append(self.tokens(index, tokens, delta))
        if reason is None:
            return events
        kind = reason.get("type")
        if kind == "stop":
            events.append(
                self.finish(index, pb.FinishReason.STOP, "", self._stop_match(reason.get("matched")))
            )
        elif kind == "length":
            events.append(self.finish(index, pb.FinishReason.LENGTH, "", None))
        elif kind == "abort":
            message = str(reason.get("message") or "aborted")
            events.append(self.finish(index, pb.FinishReason.CANCELLED, message, None))
        else:
            events.append(self.finish(index, pb.FinishReason.STOP, f"SGLang finish reason {kind!r}", None))
        return events

    def withdraw(self, events: list[pb.GenerateResponse]) -> None:
        super().withdraw(events)
        for event in events:
            if event.token is not None:
                index = event.token.output_index or 0
                self.sent_ids[index] -= len(event.token.tokens)
