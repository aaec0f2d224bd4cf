"""Hostile clients against a real sidecar, one test per finding of issue 15 (docs/SECURITY.md):
each runs an attack of ``tests.reliability.attacks.SCENARIOS`` at a size that broke the sidecar
before the limits existed, and asserts the bounded outcome — a typed refusal for the attacker,
and the bar for everyone else (RSS growth ≤ 64 MiB, ``/ready`` 200 throughout, a second
client's generate completed within 5 s)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import trio

from sidecar.north import wire
from tests.reliability.attacks import FORGED_ID, LOG_MARKER, SCENARIOS, STALLED, Run, Scenario, run_scenario

pytestmark = [pytest.mark.subprocess, pytest.mark.hostile]


async def attacked(name: str, tmp_path: Path, scenarios: Mapping[str, Scenario] = SCENARIOS) -> Run:
    """Run scenario ``name`` (of ``scenarios``) and assert the bar."""
    with trio.fail_after(120):
        run = await run_scenario(scenarios[name], tmp_path)
    print(run.verdict.line())
    assert run.verdict.within_bar, run.verdict.line()
    assert not [line for line in run.lines if "Traceback" in line], "a traceback in the sidecar's log"
    assert run.counters["requests_leaked"] == 0
    assert run.metrics.value("openengine_sidecar_active_streams") == 0
    return run


async def test_huge_request_ids_are_refused(aio_loop: Any, tmp_path: Path) -> None:
    """Finding 1: 8 streams with 1 MiB request ids on a connection that does not read (each
    event echoes its id): RSS grew by ~900 MiB. Now each gets ``end rejected
    INVALID_ARGUMENT`` (``--max-request-id-length``)."""
    run = await attacked("request-ids", tmp_path)
    assert run.verdict.notes["answers"] == {"end rejected ERROR_CODE_INVALID_ARGUMENT": 8}


async def test_call_flood_of_a_client_that_does_not_read(aio_loop: Any, tmp_path: Path) -> None:
    """Finding 2: a client that does not read sends ~245k ``describe`` calls: one task per
    call, RSS 54 -> 1,841 MiB in 30 s. Now at most ``--max-calls-per-connection`` are in
    progress and the rest are refused at once; the refusals back up into TCP (the client's
    writes block) and the stall timeout closes the connection."""
    run = await attacked("calls", tmp_path)
    assert run.verdict.notes["sent"] < 245_000  # pushed back: the sidecar stopped reading
    assert run.metrics.value("openengine_sidecar_limit_refusals_total", limit="calls_per_connection") > 0


async def test_lora_flood_keeps_the_worker_ready(aio_loop: Any, tmp_path: Path) -> None:
    """Finding 3: 60k ``listLoras`` calls from one client queued on the engine's control
    channel: Health timed out, the engine was declared lost, ``/ready`` 503 for ~6 s. Now the
    client's engine calls take a slot of a small lane (``--client-engine-calls``, a share per
    connection); the rest are refused ``OVERLOADED`` at once and the sidecar's own Health
    checks never wait behind them."""
    run = await attacked("lora", tmp_path)
    answers = run.verdict.notes["answers"]
    assert answers.get("ERROR_CODE_OVERLOADED", 0) > 0 and answers.get("ok", 0) > 0, answers
    assert set(answers) == {"ok", "ERROR_CODE_OVERLOADED"}, answers
    assert run.metrics.value("openengine_sidecar_health_checks_total", result="slow") == 0
    assert run.metrics.value("openengine_sidecar_health_checks_total", result="failed") == 0


async def test_unconvertible_integers_and_deep_nesting_harm_no_other_stream(
    aio_loop: Any, tmp_path: Path
) -> None:
    """Finding 4: a 5,000-digit integer string raised an unhandled ValueError in the JSON
    reader (the connection closed 1000, a healthy stream on it never got its ``end``); nesting
    past the decoder's recursion closed it 1007. Now each frame gets its typed answer and the
    stream beside them goes on."""
    run = await attacked("digits", tmp_path)
    rejected, rejected_mp, deep, deep_mp = run.verdict.notes["answers"]
    for end, stream in ((rejected, 2), (rejected_mp, 3)):
        assert isinstance(end, wire.End) and end.stream == stream and end.outcome == "rejected", end
        assert end.error is not None and "at most 20 digits" in end.error.message
    for reply in (deep, deep_mp):
        assert isinstance(reply, wire.ProtocolErrorMessage) and "nested too deep" in reply.message
    end = run.verdict.notes["stream 1"]
    assert isinstance(end, wire.End) and end.stream == 1 and end.outcome == "cancelled", end


async def test_client_strings_in_the_log_are_escaped_and_cut(aio_loop: Any, tmp_path: Path) -> None:
    """Finding 5: a ``requestId`` with a newline and a fake log line forged a line in the
    WARNING output. Now every client string in a log line is quoted (escaped, cut)."""
    run = await attacked("log", tmp_path)
    assert run.verdict.notes["end"].outcome == "failed"  # the engine broke a stream rule: logged
    mentions = [line for line in run.lines if LOG_MARKER in line]
    assert mentions, "the stream's request id was not logged"
    assert not [line for line in run.lines if line.startswith("2030-01-01")]  # no forged line
    assert not [line for line in run.lines if "\x1b" in line]
    assert all(len(line) < len(FORGED_ID) + 200 for line in mentions), mentions  # cut to 80


async def test_a_client_cannot_claim_the_request_ids_the_sidecar_hands_out(
    aio_loop: Any, tmp_path: Path
) -> None:
    """Finding 6: sidecar-made request ids were ``sc-<prefix>-<counter>``: a client that
    claimed the next ids made other clients' id-less requests fail ``DUPLICATE_REQUEST``, and
    the supervisor lost track of live streams (``active_streams`` below the streams open:
    outside ``--max-streams`` and drain). Now they are random, never one in flight, and every
    admitted stream stays counted."""
    run = await attacked("ids", tmp_path)
    notes = run.verdict.notes
    assert re.fullmatch(r"sc-[0-9a-f]{32}", notes["observed"]), notes["observed"]
    assert notes["a"] == {"Event": 20} and notes["b"] == {"Event": 20}, notes
    assert notes["active_streams"] == notes["open"] == 41  # every open stream counted


async def test_one_log_line_for_a_stalled_client(aio_loop: Any, tmp_path: Path) -> None:
    """Finding 7: one "stalled" line per blocked sender (2,730 lines for one client with
    3,000 pending calls), sometimes an ``OSError`` traceback from reading a closed socket's
    address. Now one line per connection (with the count of waiting senders), the peer's
    address read once at accept."""
    run = await attacked("stall", tmp_path)
    stalled = [line for line in run.lines if STALLED.search(line)]
    assert len(stalled) == 1, stalled[:5]
    assert "127.0.0.1:" in stalled[0]
    assert not [line for line in run.lines if "OSError" in line]


async def test_one_peer_cannot_take_every_stream(aio_loop: Any, tmp_path: Path) -> None:
    """Finding 11 (streams): one client address could take all ``--max-streams`` slots. Now
    it holds at most ``--peer-stream-share`` (0.5) of them; another address is still served."""
    run = await attacked("streams", tmp_path)
    assert run.verdict.notes["attacker"] == {"Event": 50, "end rejected ERROR_CODE_OVERLOADED": 50}


async def test_idle_connections_of_one_peer_are_capped(aio_loop: Any, tmp_path: Path) -> None:
    """Finding 11 (connections): idle connections ran the sidecar into ``EMFILE`` (~20k at the
    default limit; 1,600 here, its limit set to 1,536): other clients waited. Now one address
    holds at most ``--max-connections-per-peer`` (512); the rest get HTTP 503 at once and
    everyone else is served."""
    run = await attacked("connections-peer", tmp_path)
    notes = run.verdict.notes
    assert notes["open"] == 512 and notes["refused 503"] == 1600 - 512, notes
    assert not [line for line in run.lines if "Too many open files" in line]


async def test_connections_in_total_are_capped_below_the_fd_limit(aio_loop: Any, tmp_path: Path) -> None:
    """Finding 11 (connections, many addresses): past ``--max-connections`` (fitted below the
    file-descriptor limit: 1,024 here) new connections get HTTP 503 at once; the sidecar keeps
    the descriptors it needs (``/ready``, the engine), and a connected client is served."""
    run = await attacked("connections-total", tmp_path)
    notes = run.verdict.notes
    assert notes["open"] <= 1024 - 1 and notes["open"] + notes["refused 503"] == 1600, notes
    assert not [line for line in run.lines if "Too many open files" in line]
    assert [line for line in run.lines if "--max-connections 4096 lowered to 1024" in line]
