"""Fault switches of the simulated engines (``--fault NAME[=VALUE]``, repeatable).

Engine-wide faults (``--fault``):

=========================  ================================================================
``slow-start[=S]``         Health reports STARTING for S seconds (default 2) after serving
                           begins; Generate answers UNAVAILABLE meanwhile.
``unhealthy[=AFTER_S]``    Health reports NOT_READY (with a failing ``model`` check) from
                           AFTER_S seconds (default 0) after start; generation still works.
``slow-health[=N]``        Once the engine has accepted a Generate request, its next N Health
                           calls (default 1) answer after 2 s (a stalled control path).
``wrong-revision[=N]``     ServerInfo.schema_revision = N (default 0, invalid).
``wrong-min-client[=N]``   ServerInfo.minimum_client_revision = N (default 4).
``wrong-release[=S]``      ServerInfo.schema_release = S (default ``main``).
``wrong-role[=ROLE]``      ServerInfo advertises ROLE (default: the next role) while the
                           engine keeps behaving as ``--role``.
``no-drain``               Drain answers UNIMPLEMENTED.
``ignore-abort``           Abort answers ABORTED but the request keeps running.
``drop-aborts[=N]``        The first N Abort calls (default: all) fail with UNAVAILABLE;
                           they still count in ``aborts_received``.
``late-generate[=S]``      A Generate request reaches the engine S seconds (default 1) after
                           its stream opened, as when its packets are retransmitted after a
                           network partition while the Abort came on another connection: it
                           is registered only then, and a client reset meanwhile is noticed
                           after it (``--orphans hold`` holds it).
``kv-gap[=N]``             KV events: skip a sequence number after N batches (default 1).
``kv-publisher-restart[=N]`` KV events: the publisher restarts at sequence 0 after N batches.
``kv-history-lost[=N]``    KV events: batch N (default 1) is lost with all older history.
``kv-tagged-arrays``       KV events (ZMQ): events as tagged arrays instead of maps.
``kv-large-batch[=BYTES]`` KV events (gRPC): the first batch each rank sends live carries
                           about BYTES (default 3 MB) more of synthetic ``BlockStored``
                           events (seconds of decoding for a betterproto2 client).
``oversized-answer[=RPC[:BYTES]]`` every answer of the ``Control`` call RPC (default
                           ``GetLoad``; ``Drain``: its first event) carries an unknown field
                           that makes it BYTES long (default 8 MiB); repeatable, one RPC each.
``hold-after-terminal[=N]`` the first N Generate calls (default: all) stay open after their
                           terminal event until the client leaves (no trailers).
=========================  ================================================================

Hangs (runtime switches, no ``--fault``; ``sidecar/mock/hangs.py``): ``mock-engine`` toggles a
hang of its Control service on ``SIGUSR1`` (Health, GetLoad, Abort … wait; Generate runs) and a
hang of Generate on ``SIGUSR2`` (streams stop advancing; Health answers READY). A whole-process
hang is ``SIGSTOP`` / ``SIGCONT``.

Contract violations (engine-wide flags, no value), one per rule the conformance suite
(``openengine-sidecar conformance``, docs/CONFORMANCE.md) enforces, so each of its
checks can be shown to fail:

==========================  ===============================================================
``zero-presence``           ServerInfo reports explicit zeros it should leave absent
                            (``decode_context_parallel_size``, ``capacity.kv_block_size``).
``phantom-alias``           ModelInfo lists an alias no call accepts.
``any-model``               GetModelInfo answers for any model name (no NOT_FOUND).
``kv-wildcard-source``      GetKvEventSources advertises ``0.0.0.0`` as the endpoint host.
``kv-missing-rank``         GetKvEventSources leaves out the last DP rank.
``kv-wrong-rank``           KV batches report DP rank + 1.
``kv-replay-skip``          KV replay / resume starts one batch after the one asked for.
``no-connector``            a prefill/decode engine advertises a disabled KV connector.
``late-invalid``            a request without input is accepted, then fails with one
                            ``EngineError{INVALID_ARGUMENT}`` (instead of a status).
``late-role-mismatch``      a role mismatch is accepted, then fails with one
                            ``EngineError{ROLE_MISMATCH}`` (instead of a status).
``lenient-metadata``        malformed ``openengine-*`` numbers are ignored.
``repeated-metadata``       repeated ``openengine-*`` keys are accepted (last wins).
``abort-finished-aborted``  Abort of a finished request answers ABORTED.
``abort-twice-error``       a second Abort naming a request id answers FAILED_PRECONDITION.
``abort-no-target-found``   Abort with no target answers NOT_FOUND (not INVALID_ARGUMENT).
``abort-unknown-aborted``   Abort of an unknown request id answers ABORTED.
``drain-keeps-accepting``   Drain ignores ``stop_accepting_new_requests``.
``drain-ignores-deadline``  Drain ignores ``deadline_ms`` (waits for in-flight work).
``drain-early-complete``    Drain without a deadline sends COMPLETE right after STARTED.
``lora-lenient``            LoadLora skips argument checks (id, name, absolute path).
``lora-not-idempotent``     loading the same adapter twice answers ALREADY_EXISTS.
``drain-event-after-complete`` Drain sends one more IN_PROGRESS after COMPLETE.
``drain-empty-event``       Drain sends a DrainResponse with no event right after STARTED.
``drain-no-complete``       a Drain without a deadline closes OK once work ended, without
                            COMPLETE.
``kv-empty-response``       every ``SubscribeKvEvents`` stream begins with a response that
                            carries no event.
``kv-event-after-error``    a ``SubscribeKvEvents`` stream with ``include_snapshot`` sends,
                            after its snapshot, an ``EngineError`` and then one more batch.
``session-foreign-rank``    PrefillReady's ``kv_session`` names ``dp_rank`` = the DP size (a
                            rank neither engine of a one-rank pair has; the simulated decode
                            engine ignores it).
``kv-undecodable``          the first KV batch of each DP rank carries one more event that
                            does not decode (gRPC: a ``KvEvent`` with none set; ZMQ: an
                            integer where an event belongs).
==========================  ===============================================================

Stream faults — engine-wide with ``--fault``, or for one request through
``GenerateRequest.extra`` ``{"mock": {"faults": ["stall=2"]}}``. N counts token events
sent on the stream (over all outputs):

=============================  ============================================================
``close-without-terminal[=N]`` end the stream OK after N token events, no terminal (default 1)
``error-after[=N]``            one terminal ``EngineError`` (INTERNAL, retryable) after N
                               token events (default 1)
``crash-after[=N]``            the process exits (status 70) after N token events (default 1)
``stall[=N]``                  stop sending after N token events (default 1); the request
                               stays running until Abort or the client leaves
``status-after[=N]``           end the call with status INTERNAL after N token events
                               (default 1), no terminal event
``no-usage``                   the final event carries no Usage
``token-after-finish``         one more TokenOutput for an output after its finish
``no-output-index``            TokenOutput events carry no ``output_index``
``skip-finish``                with several outputs, the first one to finish gets no
                               ``GenerationFinished``
``early-usage``                the first TokenOutput carries Usage too
``prompt-twice``               PromptOutput is sent twice
``no-stop-match``              STOP finishes carry no ``stop_match``
``event-after-error``          one more TokenOutput after a terminal ``EngineError``
``ignore-max-tokens``          every output generates one token more than ``max_tokens``
``oversized-event[=BYTES]``    right after the first token event, one more ``TokenOutput``
                               whose text is BYTES long (default 8 MiB)
``wrong-request-id``           TokenOutput events name another request (``someone-else``)
``empty-event``                right after the second token event, a GenerateResponse with
                               no event
``output-index-range``         right after the second token event, a TokenOutput for
                               ``output_index`` = ``num_sequences`` (one past the last)
``undecodable-event``          right after the second token event, a message that is no
                               GenerateResponse (a ``request_id`` that is not UTF-8)
=============================  ============================================================
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from sidecar.mock.kvevents_wire import LARGE_BATCH_BYTES


class FaultSpecError(ValueError):
    """A ``--fault`` value that names no fault or has a malformed value."""


#: Stream faults that are plain flags (kept in ``StreamFaults.flags``).
STREAM_FLAGS = frozenset(
    {
        "no-output-index",
        "skip-finish",
        "early-usage",
        "prompt-twice",
        "no-stop-match",
        "event-after-error",
        "ignore-max-tokens",
        "wrong-request-id",
        "empty-event",
        "output-index-range",
        "undecodable-event",
    }
)
STREAM_FAULTS = (
    frozenset(
        {
            "close-without-terminal",
            "error-after",
            "crash-after",
            "stall",
            "no-usage",
            "token-after-finish",
            "oversized-event",
            "status-after",
        }
    )
    | STREAM_FLAGS
)
#: Engine-wide contract violations that are plain flags (kept in ``Faults.flags``).
ENGINE_FLAGS = frozenset(
    {
        "zero-presence",
        "phantom-alias",
        "any-model",
        "kv-wildcard-source",
        "kv-missing-rank",
        "kv-wrong-rank",
        "kv-replay-skip",
        "no-connector",
        "late-invalid",
        "late-role-mismatch",
        "lenient-metadata",
        "repeated-metadata",
        "abort-finished-aborted",
        "abort-twice-error",
        "abort-no-target-found",
        "abort-unknown-aborted",
        "drain-keeps-accepting",
        "drain-ignores-deadline",
        "drain-early-complete",
        "lora-lenient",
        "lora-not-idempotent",
        "drain-event-after-complete",
        "drain-empty-event",
        "drain-no-complete",
        "kv-empty-response",
        "kv-event-after-error",
        "kv-undecodable",
        "session-foreign-rank",
    }
)
ENGINE_FAULTS = (
    frozenset(
        {
            "slow-start",
            "unhealthy",
            "slow-health",
            "wrong-revision",
            "wrong-min-client",
            "wrong-release",
            "wrong-role",
            "no-drain",
            "ignore-abort",
            "drop-aborts",
            "late-generate",
            "kv-gap",
            "kv-publisher-restart",
            "kv-history-lost",
            "kv-tagged-arrays",
            "kv-large-batch",
            "oversized-answer",
            "hold-after-terminal",
        }
    )
    | ENGINE_FLAGS
)
ALL_FAULTS = STREAM_FAULTS | ENGINE_FAULTS
_ROLES = ("aggregated", "prefill", "decode")
#: Size of an ``oversized-*`` message when the fault gives none: over the sidecar's default
#: bounds (4 MiB, gRPC's own default).
OVERSIZED_BYTES = 8 * 1024 * 1024
#: The ``Control`` calls ``oversized-answer`` can name.
CONTROL_RPCS = (
    "GetServerInfo",
    "GetModelInfo",
    "GetLoad",
    "Health",
    "Abort",
    "Drain",
    "LoadLora",
    "UnloadLora",
    "ListLoras",
    "GetKvEventSources",
)


@dataclass(frozen=True)
class StreamFaults:
    """Faults applied to a Generate stream (None = off)."""

    close_without_terminal: int | None = None
    error_after: int | None = None
    crash_after: int | None = None
    stall: int | None = None
    status_after: int | None = None
    no_usage: bool = False
    token_after_finish: bool = False
    oversized_event: int | None = None  # bytes of the extra event's text
    flags: frozenset[str] = frozenset()  # names from STREAM_FLAGS

    @property
    def any(self) -> bool:
        return self != StreamFaults()

    def has(self, name: str) -> bool:
        return name in self.flags

    def merged(self, other: StreamFaults) -> StreamFaults:
        """``other``'s switches on top of ours."""
        changes = {k: v for k, v in other.__dict__.items() if k != "flags" and v not in (None, False)}
        return replace(self, flags=self.flags | other.flags, **changes)


@dataclass(frozen=True)
class Faults:
    """Every fault switch of one engine."""

    slow_start: float | None = None
    unhealthy_after: float | None = None
    slow_health: int | None = None
    wrong_revision: int | None = None
    wrong_min_client: int | None = None
    wrong_release: str | None = None
    wrong_role: str | None = None
    no_drain: bool = False
    ignore_abort: bool = False
    drop_aborts: int | None = None  # -1 = all
    late_generate: float | None = None  # seconds
    kv_gap: int | None = None
    kv_publisher_restart: int | None = None
    kv_history_lost: int | None = None
    kv_tagged_arrays: bool = False
    kv_large_batch: int | None = None  # bytes
    oversized_answers: tuple[tuple[str, int], ...] = ()  # (Control RPC, bytes)
    hold_after_terminal: int | None = None  # -1 = all
    flags: frozenset[str] = frozenset()  # names from ENGINE_FLAGS
    stream: StreamFaults = field(default_factory=StreamFaults)

    def has(self, name: str) -> bool:
        return name in self.flags

    def oversized(self, rpc: str) -> int | None:
        """Bytes every answer of ``rpc`` is padded to (fault ``oversized-answer``), or None."""
        return dict(self.oversized_answers).get(rpc)

    def kv_options(self) -> dict[str, object]:
        """The KV-event faults, for the KV publishers (absent when off)."""
        out: dict[str, object] = {}
        if self.kv_gap is not None:
            out["kv_gap"] = self.kv_gap
        if self.kv_publisher_restart is not None:
            out["kv_publisher_restart"] = self.kv_publisher_restart
        if self.kv_history_lost is not None:
            out["kv_history_lost"] = self.kv_history_lost
        if self.kv_tagged_arrays:
            out["kv_tagged_arrays"] = True
        if self.kv_large_batch is not None:
            out["kv_large_batch"] = self.kv_large_batch
        if self.has("kv-wrong-rank"):
            out["kv_wrong_rank"] = True
        if self.has("kv-replay-skip"):
            out["kv_replay_skip"] = True
        for name in ("kv-empty-response", "kv-event-after-error", "kv-undecodable"):
            if self.has(name):
                out[name.replace("-", "_")] = True
        return out


def _int(name: str, value: str | None, default: int, minimum: int = 0) -> int:
    if value is None:
        return default
    try:
        n = int(value)
    except ValueError:
        raise FaultSpecError(f"fault {name}: expected an integer, got {value!r}") from None
    if n < minimum:
        raise FaultSpecError(f"fault {name}: must be >= {minimum}, got {n}")
    return n


def _float(name: str, value: str | None, default: float) -> float:
    if value is None:
        return default
    try:
        x = float(value)
    except ValueError:
        raise FaultSpecError(f"fault {name}: expected seconds, got {value!r}") from None
    if x < 0:
        raise FaultSpecError(f"fault {name}: must be >= 0, got {x}")
    return x


def _split(spec: str) -> tuple[str, str | None]:
    name, sep, value = spec.strip().partition("=")
    name = name.strip().lower().replace("_", "-")
    if name not in ALL_FAULTS:
        raise FaultSpecError(f"unknown fault {name!r}; known: {', '.join(sorted(ALL_FAULTS))}")
    return name, (value.strip() if sep else None)


def parse_stream_faults(specs: Iterable[str]) -> StreamFaults:
    """Parse stream-fault specs only (the per-request ``extra`` form)."""
    kw: dict[str, object] = {}
    for spec in specs:
        name, value = _split(spec)
        if name not in STREAM_FAULTS:
            raise FaultSpecError(
                f"fault {name!r} is engine-wide; only {sorted(STREAM_FAULTS)} apply per request"
            )
        _stream_fault(name, value, kw)
    return StreamFaults(**kw)  # type: ignore[arg-type]


def _stream_fault(name: str, value: str | None, kw: dict[str, object]) -> None:
    if name in STREAM_FLAGS:
        if value is not None:
            raise FaultSpecError(f"fault {name} takes no value")
        previous: frozenset[str] = kw.get("flags", frozenset())  # type: ignore[assignment]
        kw["flags"] = previous | {name}
    elif name in ("no-usage", "token-after-finish"):
        if value is not None:
            raise FaultSpecError(f"fault {name} takes no value")
        kw[name.replace("-", "_")] = True
    elif name == "oversized-event":
        kw["oversized_event"] = _int(name, value, OVERSIZED_BYTES, minimum=1)
    else:
        kw[name.replace("-", "_")] = _int(name, value, 1)


def _oversized_answer(value: str | None) -> tuple[str, int]:
    rpc, _, size = (value or "GetLoad").partition(":")
    if rpc not in CONTROL_RPCS:
        raise FaultSpecError(
            f"fault oversized-answer: expected one of {', '.join(CONTROL_RPCS)}, got {rpc!r}"
        )
    return rpc, _int("oversized-answer", size or None, OVERSIZED_BYTES, minimum=1)


def parse_faults(specs: Iterable[str], *, role: str = "aggregated") -> Faults:
    """Parse ``--fault`` values. Raises :class:`FaultSpecError` on a bad spec."""
    kw: dict[str, object] = {}
    stream_kw: dict[str, object] = {}
    flags: set[str] = set()
    for spec in specs:
        name, value = _split(spec)
        if name in STREAM_FAULTS:
            _stream_fault(name, value, stream_kw)
        elif name in ENGINE_FLAGS:
            if value is not None:
                raise FaultSpecError(f"fault {name} takes no value")
            flags.add(name)
        elif name == "slow-start":
            kw["slow_start"] = _float(name, value, 2.0)
        elif name == "unhealthy":
            kw["unhealthy_after"] = _float(name, value, 0.0)
        elif name == "wrong-revision":
            kw["wrong_revision"] = _int(name, value, 0)
        elif name == "wrong-min-client":
            kw["wrong_min_client"] = _int(name, value, 4)
        elif name == "wrong-release":
            kw["wrong_release"] = value if value is not None else "main"
        elif name == "wrong-role":
            if value is None:
                value = _ROLES[(_ROLES.index(role) + 1) % len(_ROLES)] if role in _ROLES else "prefill"
            if value not in _ROLES:
                raise FaultSpecError(f"fault wrong-role: expected one of {_ROLES}, got {value!r}")
            kw["wrong_role"] = value
        elif name == "drop-aborts":
            kw["drop_aborts"] = _int(name, value, -1)
        elif name == "hold-after-terminal":
            kw["hold_after_terminal"] = _int(name, value, -1)
        elif name == "late-generate":
            kw["late_generate"] = _float(name, value, 1.0)
        elif name == "slow-health":
            kw["slow_health"] = _int(name, value, 1)
        elif name == "kv-gap":
            kw["kv_gap"] = _int(name, value, 1)
        elif name == "kv-publisher-restart":
            kw["kv_publisher_restart"] = _int(name, value, 1)
        elif name == "kv-history-lost":
            kw["kv_history_lost"] = _int(name, value, 1)
        elif name == "kv-large-batch":
            kw["kv_large_batch"] = _int(name, value, LARGE_BATCH_BYTES, minimum=1)
        elif name == "oversized-answer":
            previous: tuple[tuple[str, int], ...] = kw.get("oversized_answers", ())  # type: ignore[assignment]
            kw["oversized_answers"] = (*previous, _oversized_answer(value))
        else:  # flags
            if value is not None:
                raise FaultSpecError(f"fault {name} takes no value")
            kw[name.replace("-", "_")] = True
    return Faults(stream=StreamFaults(**stream_kw), flags=frozenset(flags), **kw)  # type: ignore[arg-type]
