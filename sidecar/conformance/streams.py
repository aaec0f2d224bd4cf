"""Recorded Generate streams and the schema's stream rules, checked one rule at a time (I/O-free).

The EngineClient stops at the first broken rule; here every rule is its own function over
a whole recorded stream, so each conformance check reports exactly the rule it names and
one misbehaviour does not mask another. Rules: the schema's api.md, "Generation API" (output
scope, finishes, ``Usage``, ``PromptOutput``, ``stop_match``) and "Standard errors"
(``EngineError`` is terminal; the stream then closes OK). The sidecar's own checker of the
same rules is :mod:`sidecar.openengine.stream_rules`; every rule it enforces has its function
here (its ``CONFORMANCE_CHECKS`` names the check that applies it).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import betterproto2

from sidecar.openengine import pb

__all__ = [
    "StreamRecord",
    "after_error_violations",
    "after_finish_violations",
    "close_violations",
    "event_violations",
    "finish_count_violations",
    "kind",
    "lost_violations",
    "max_tokens_violations",
    "output_index_violations",
    "prompt_once_violations",
    "request_id_violations",
    "stop_match_violations",
    "terminal_position",
    "tokens_per_output",
    "usage_violations",
    "wire_violations",
]


def kind(event: pb.GenerateResponse) -> str:
    """The ``event`` oneof's name (``token``, ``finished``, ``prompt``, ``prefill_ready``, ``error``; ``""``)."""
    name, _ = betterproto2.which_one_of(event, "event")
    return name or ""


@dataclass
class StreamRecord:
    """Everything one Generate call produced, in order.

    ``end`` is how the call ended: ``ok`` (the engine closed it with status OK),
    ``status`` (a non-OK gRPC status, in ``status``/``status_message``), ``transport``
    (connection lost: ``error``), ``protocol`` (a message the client cannot take:
    ``error``), ``timeout`` (we gave up waiting: ``gave_up`` says after what) or ``left`` (we
    closed it on purpose). ``aborted``: we sent an Abort for it.
    """

    label: str
    request: pb.GenerateRequest
    events: list[pb.GenerateResponse] = field(default_factory=list)
    end: str = "ok"
    status: str | None = None
    status_message: str = ""
    error: str = ""
    gave_up: str = ""
    aborted: bool = False
    notes: list[str] = field(default_factory=list)

    @property
    def num_outputs(self) -> int:
        s = self.request.sampling
        n = s.num_sequences if s is not None else None
        return 1 if n is None else max(1, n)

    @property
    def kinds(self) -> list[str]:
        return [kind(e) for e in self.events]

    @property
    def refused(self) -> bool:
        """Refused before acceptance: a non-OK status and no event."""
        return self.end == "status" and not self.events

    def summary(self) -> str:
        counts = Counter(self.kinds)
        parts = [f"{n} {k or 'empty'}" for k, n in counts.items()]
        end = self.end if self.end != "status" else f"status {self.status}"
        return f"{self.label}: {', '.join(parts) or 'no events'}; ended {end}"

    def where(self, i: int) -> str:
        return f"stream {self.label!r}, event #{i + 1} ({kind(self.events[i]) or 'no event'})"


def _index(event: pb.GenerateResponse) -> int | None:
    k = kind(event)
    if k == "token":
        return event.token.output_index  # type: ignore[union-attr]
    if k == "finished":
        return event.finished.output_index  # type: ignore[union-attr]
    return None


def terminal_position(rec: StreamRecord) -> int | None:
    """Index of the terminal event: the first ``EngineError`` or ``PrefillReady``, or the
    finish that completes every output; ``None`` if the stream never reached one."""
    n = rec.num_outputs
    done: set[int] = set()
    for i, ev in enumerate(rec.events):
        k = kind(ev)
        if k in ("error", "prefill_ready"):
            return i
        if k == "finished":
            idx = _index(ev)
            if idx is not None and idx < n:
                done.add(idx)
                if len(done) == n:
                    return i
    return None


def lost_violations(rec: StreamRecord) -> list[str]:
    """An accepted stream whose connection was lost before its terminal event never ended:
    the schema's stream rules cannot hold for it (every check that judges it says so)."""
    if rec.end != "transport" or not rec.events or terminal_position(rec) is not None:
        return []
    return [
        f"stream {rec.label!r}: the connection was lost after {len(rec.events)} event(s) with no terminal "
        f"event ({rec.error or 'transport error'})"
    ]


def request_id_violations(rec: StreamRecord) -> list[str]:
    """Every response names the stream's own ``request_id`` (or leaves it empty)."""
    own = rec.request.request_id
    return [
        f"{rec.where(i)}: request_id {ev.request_id!r} on the stream of {own!r}"
        for i, ev in enumerate(rec.events)
        if ev.request_id and ev.request_id != own
    ]


def event_violations(rec: StreamRecord) -> list[str]:
    """Every response carries one event (none set, or one of a field this schema lacks, is none)."""
    return [
        f"{rec.where(i)}: a GenerateResponse with no event" for i, ev in enumerate(rec.events) if not kind(ev)
    ]


def close_violations(rec: StreamRecord) -> list[str]:
    """Once accepted (an event sent), the stream ends with its terminal event and the call then
    closes with status OK at once: no non-OK status and no reset after acceptance, no stream
    left open or silent.

    A stream that failed (``EngineError``) is :func:`after_error_violations`' to judge; one
    lost before its terminal, :func:`lost_violations`'; a stream we gave up on after an Abort
    without its terminal, the cancellation checks'.
    """
    kinds = rec.kinds
    if "error" in kinds or rec.end in ("ok", "left", "protocol") or rec.refused:
        return []
    terminal = terminal_position(rec)
    n = len(rec.events)
    if rec.end == "status":
        return [
            f"stream {rec.label!r}: ended with status {rec.status} ({rec.status_message}) after {n} event(s): "
            "after acceptance a failure is one EngineError and the call closes OK"
        ]
    if rec.end == "transport":
        if terminal is None:
            return []  # lost_violations
        return [
            f"stream {rec.label!r}: the call was lost after its terminal event (#{terminal + 1}) ({rec.error})"
        ]
    if terminal is not None:
        return [
            f"stream {rec.label!r}: the call stayed open after its terminal event (#{terminal + 1}): {rec.gave_up}"
        ]
    if rec.aborted:
        return []
    return [f"stream {rec.label!r}: {rec.gave_up} ({n} event(s), no terminal)"]


def wire_violations(rec: StreamRecord) -> list[str]:
    """Every message of the call is one the client can take (decodes; fits the size bound)."""
    if rec.end != "protocol":
        return []
    return [f"stream {rec.label!r}: after {len(rec.events)} event(s): {rec.error}"]


def output_index_violations(rec: StreamRecord) -> list[str]:
    """``TokenOutput``/``GenerationFinished`` carry ``output_index`` in ``0 … n-1``."""
    out = []
    for i, ev in enumerate(rec.events):
        k = kind(ev)
        if k not in ("token", "finished"):
            continue
        idx = _index(ev)
        if idx is None:
            out.append(f"{rec.where(i)}: no output_index")
        elif idx >= rec.num_outputs:
            out.append(f"{rec.where(i)}: output_index {idx} but the request has {rec.num_outputs} output(s)")
    return out


def finish_count_violations(rec: StreamRecord, *, prefill: bool = False) -> list[str]:
    """A successful stream ends every output with exactly one ``GenerationFinished``
    (a prefill stream with exactly one ``PrefillReady``); a failed one finishes no output twice.

    Streams we left, or that ended with a non-OK status or a lost connection, are judged
    only on duplicates.
    """
    kinds = rec.kinds
    out: list[str] = []
    if prefill:
        ready = kinds.count("prefill_ready")
        if ready > 1:
            out.append(f"stream {rec.label!r}: {ready} PrefillReady events")
        if kinds.count("finished"):
            out.append(f"stream {rec.label!r}: a prefill stream sent GenerationFinished")
        if rec.end == "ok" and "error" not in kinds and ready == 0:
            out.append(f"stream {rec.label!r}: closed OK without PrefillReady or EngineError")
        return out
    counts: Counter[int] = Counter()
    for ev in rec.events:
        if kind(ev) == "finished":
            idx = _index(ev)
            if idx is not None:
                counts[idx] += 1
    for idx, c in sorted(counts.items()):
        if c > 1:
            out.append(f"stream {rec.label!r}: output {idx} has {c} GenerationFinished events")
    if rec.end == "ok" and "error" not in kinds:
        for idx in range(rec.num_outputs):
            if counts[idx] == 0:
                out.append(
                    f"stream {rec.label!r}: closed OK but output {idx} has no GenerationFinished"
                    f" ({rec.num_outputs} output(s) requested)"
                )
    return out


def after_finish_violations(rec: StreamRecord) -> list[str]:
    """Nothing for an index after its finish; nothing at all after the stream's success terminal."""
    out: list[str] = []
    finished: set[int] = set()
    terminal = terminal_position(rec)
    for i, ev in enumerate(rec.events):
        k = kind(ev)
        if terminal is not None and i > terminal and kind(rec.events[terminal]) != "error":
            out.append(f"{rec.where(i)}: sent after the stream's terminal event (#{terminal + 1})")
            continue
        idx = _index(ev)
        if idx is not None and idx in finished:
            what = "a token" if k == "token" else "a second GenerationFinished"
            out.append(f"{rec.where(i)}: {what} for output {idx} after its GenerationFinished")
        if k == "finished" and idx is not None:
            finished.add(idx)
    return out


def after_error_violations(rec: StreamRecord) -> list[str]:
    """Nothing after an ``EngineError``, and the call then closes with status OK."""
    kinds = rec.kinds
    if "error" not in kinds:
        return []
    first = kinds.index("error")
    out = [f"{rec.where(i)}: sent after EngineError (#{first + 1})" for i in range(first + 1, len(kinds))]
    if rec.end == "status":
        out.append(f"stream {rec.label!r}: ended with status {rec.status} after EngineError (must close OK)")
    return out


def usage_violations(rec: StreamRecord) -> list[str]:
    """``Usage`` on the final event (last finish, ``PrefillReady`` or ``EngineError``) and nowhere else.

    Without a terminal (a stream that broke off or lacks a finish: other rules' concern)
    its last event counts as final but need not carry Usage.
    """
    out: list[str] = []
    terminal = terminal_position(rec)
    final = terminal if terminal is not None else len(rec.events) - 1
    for i, ev in enumerate(rec.events):
        if i == final:
            if terminal is not None and ev.usage is None:
                out.append(f"{rec.where(i)}: the final event carries no Usage")
        elif ev.usage is not None:
            out.append(f"{rec.where(i)}: Usage on a non-final event")
    return out


def prompt_once_violations(rec: StreamRecord) -> list[str]:
    n = rec.kinds.count("prompt")
    return [f"stream {rec.label!r}: {n} PromptOutput events"] if n > 1 else []


def _stop_sets(req: pb.GenerateRequest) -> tuple[set[int], set[str]]:
    ids: set[int] = set()
    texts: set[str] = set()
    if req.stopping is not None:
        for cond in req.stopping.conditions:
            name, value = betterproto2.which_one_of(cond, "condition")
            if name == "stop_token_id" and isinstance(value, int):
                ids.add(value)
            elif name == "stop_text" and isinstance(value, str):
                texts.add(value)
    return ids, texts


def stop_match_violations(rec: StreamRecord) -> list[str]:
    """A ``STOP`` finish names what matched: a requested stop token or string, or the EOS token."""
    out: list[str] = []
    ids, texts = _stop_sets(rec.request)
    for i, ev in enumerate(rec.events):
        if kind(ev) != "finished":
            continue
        fin = ev.finished
        assert fin is not None
        if fin.reason != pb.FinishReason.STOP:
            continue
        match = fin.stop_match
        name, value = betterproto2.which_one_of(match, "match") if match is not None else ("", None)
        if not name:
            out.append(f"{rec.where(i)}: reason STOP without stop_match")
        elif name == "stop_token_id" and value not in ids:
            out.append(f"{rec.where(i)}: stop_match names stop token {value}, not one the request asked for")
        elif name == "stop_text" and value not in texts:
            out.append(f"{rec.where(i)}: stop_match names stop text {value!r}, not one the request asked for")
    return out


def tokens_per_output(rec: StreamRecord) -> Counter[int]:
    """Tokens generated per output index up to its finish (a missing index counts as 0 for
    one-output requests; tokens after a finish are the after-finish rule's concern)."""
    counts: Counter[int] = Counter()
    finished: set[int] = set()
    for ev in rec.events:
        k = kind(ev)
        idx = _index(ev)
        if k == "finished" and idx is not None:
            finished.add(idx)
        if k != "token":
            continue
        if idx is None:
            if rec.num_outputs != 1:
                continue
            idx = 0
        if idx not in finished:
            counts[idx] += len(ev.token.tokens)  # type: ignore[union-attr]
    return counts


def max_tokens_violations(rec: StreamRecord) -> list[str]:
    """No output generates more than ``stopping.max_tokens`` tokens; Usage agrees."""
    st = rec.request.stopping
    limit = st.max_tokens if st is not None else None
    if limit is None:
        return []
    out = [
        f"stream {rec.label!r}: output {idx} generated {n} tokens with max_tokens {limit}"
        for idx, n in sorted(tokens_per_output(rec).items())
        if n > limit
    ]
    for ev in rec.events:
        if ev.usage is not None and ev.usage.completion_tokens > limit * rec.num_outputs:
            out.append(
                f"stream {rec.label!r}: Usage.completion_tokens {ev.usage.completion_tokens} exceeds "
                f"max_tokens {limit} x {rec.num_outputs} output(s)"
            )
    return out
