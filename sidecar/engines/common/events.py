"""The stream rules every adapter keeps when it turns engine outputs into ``GenerateResponse`` events.

One :class:`StreamEvents` (an adapter subclasses it with the conversion of its engine's outputs)
per request. Rules (schema "Generation API"): every ``TokenOutput`` and ``GenerationFinished``
carries ``output_index``; exactly one ``GenerationFinished`` per output, and nothing for an
index after it; ``PromptOutput`` at most once, first; ``Usage`` on the final event only (the
last ``GenerationFinished``, or the one terminal ``EngineError``). Events built but not sent (an
Abort came first) are withdrawn, as if never built. I/O-free.
"""

from __future__ import annotations

from typing import Any

from sidecar.openengine import pb


class StreamEvents:
    """Builds one request's events; remembers what was built for the terminal ones."""

    def __init__(self, request_id: str, num_outputs: int, *, eos_token_id: int | None) -> None:
        self.request_id = request_id
        self.num_outputs = num_outputs
        self.eos_token_id = eos_token_id
        self.finished: set[int] = set()
        self.completion_tokens = [0] * num_outputs
        self.prompt_tokens = 0
        self.cached_tokens: int | None = None
        self.prompt_sent = False

    @property
    def done(self) -> bool:
        return len(self.finished) == self.num_outputs

    def usage(self) -> pb.Usage:
        completion = sum(self.completion_tokens)
        return pb.Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=completion,
            total_tokens=self.prompt_tokens + completion,
            cached_prompt_tokens=self.cached_tokens,
        )

    def event(self, **kwargs: Any) -> pb.GenerateResponse:
        return pb.GenerateResponse(request_id=self.request_id, **kwargs)

    def tokens(self, index: int, tokens: list[pb.TokenInfo], text: str) -> pb.GenerateResponse:
        """A ``TokenOutput`` of output ``index`` (counted for Usage)."""
        self.completion_tokens[index] += len(tokens)
        return self.event(token=pb.TokenOutput(output_index=index, tokens=tokens, text=text))

    def finish(
        self, index: int, reason: pb.FinishReason, message: str, match: pb.StopMatch | None
    ) -> pb.GenerateResponse:
        """The ``GenerationFinished`` of output ``index`` (Usage when it is the last one)."""
        self.finished.add(index)
        event = self.event(
            finished=pb.GenerationFinished(
                output_index=index, reason=reason, message=message, stop_match=match
            )
        )
        if self.done:
            event.usage = self.usage()
        return event

    def withdraw(self, events: list[pb.GenerateResponse]) -> None:
        """``events`` were built but will not be sent (an Abort came first): as if never built."""
        for event in events:
            if event.token is not None:
                self.completion_tokens[event.token.output_index or 0] -= len(event.token.tokens)
            if event.finished is not None:
                self.finished.discard(event.finished.output_index or 0)

    def cancel_rest(self, message: str) -> list[pb.GenerateResponse]:
        """``GenerationFinished{CANCELLED}`` for every unfinished output (Usage on the last)."""
        return [
            self.finish(i, pb.FinishReason.CANCELLED, message, None)
            for i in range(self.num_outputs)
            if i not in self.finished
        ]

    def error(self, code: pb.ErrorCode, message: str, *, retryable: bool) -> pb.GenerateResponse:
        """The one terminal ``EngineError`` (with Usage)."""
        self.finished.update(range(self.num_outputs))
        return self.event(
            error=pb.EngineError(code=code, message=message, retryable=retryable), usage=self.usage()
        )


class EngineFailure(Exception):
    """The engine ended an accepted request with an internal error."""
