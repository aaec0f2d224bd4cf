"""Engines of every OpenEngine schema lineage served end to end: real processes, sockets, signals.

For each schema a simulated engine can be built on (``mock-engine --schema``) and each
release form (a source commit, or a Buf Schema Registry commit — unknown to this build,
so served by feature detection with its warning): an aggregated engine behind ``run``
(a generation, ``describe``, a SIGTERM drain with ``--drain-engine``: Drain-less schemas
drain locally) and a prefill/decode pair behind two sidecars driven by the ``disagg``
command (``disagg``), whose output must equal the aggregated one.
"""

from __future__ import annotations

import json
import re
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
import trio

from sidecar.client.sidecar_client import open_sidecar
from tests.e2e.harness import generate_request, mock_engine, open_together, sidecar

PROMPT = " ba be bi" * 6
#: The P/D flavour per case: legacy vLLM and SGLang (context-first without client bootstrap),
#: SGLang with client bootstrap, TensorRT-LLM.
CASES = [
    ("a66ff6f", "source", "trtllm"),
    ("a66ff6f", "bsr", "vllm"),
    ("4def7c5", "source", "sglang"),
    ("4def7c5", "bsr", "vllm"),
    ("31be5db", "source", "sglang"),
    ("31be5db", "bsr", "trtllm"),
]
DRAIN = {"a66ff6f": True, "4def7c5": False, "31be5db": False}


def token_ids(events: list[Any]) -> list[int]:
    return [t.token_id for e in events if e.response.token is not None for t in e.response.token.tokens]


@pytest.mark.parametrize(("schema", "form", "flavor"), CASES, ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in CASES])
async def test_lineage_served_described_disaggregated_and_drained(
    aio_loop: Any, tmp_path: Path, schema: str, form: str, flavor: str
) -> None:
    built = ("--flavor", flavor, "--schema", schema, "--release-form", form)
    with trio.fail_after(60):
        engines = [
            mock_engine(tmp_path, *built, "--token-delay-ms", "20", name="agg"),
            mock_engine(tmp_path, *built, "--role", "prefill", name="prefill"),
            mock_engine(tmp_path, *built, "--role", "decode", name="decode"),
        ]
        async with open_together(*engines) as (ae, pe, de):
            sidecars = [
                sidecar(ae.address, "--no-kv-events", "--drain-engine", "--drain-timeout", "10"),
                sidecar(pe.address, "--no-kv-events"),
                sidecar(de.address, "--no-kv-events"),
            ]
            async with open_together(*sidecars) as (asc, psc, dsc):
                await _serve(schema, form, flavor, asc, psc, dsc)


async def _serve(schema: str, form: str, flavor: str, asc: Any, psc: Any, dsc: Any) -> None:
    request = {"prompt": PROMPT, "stopping": {"maxTokens": 6}}  # what the disagg command sends
    # describe: the release, its lineage, known or untested
    async with open_sidecar(asc.ws) as client:
        card: dict[str, Any] = await client.call("describe")
    compat = card["compatibility"]
    assert card["schema"]["releaseKind"] == ("commit" if form == "source" else "bsr")
    if form == "source":
        assert (compat["status"], compat["knownRelease"]) == ("known", schema)
    else:
        assert (compat["status"], compat["resembles"]) == ("untested", schema)
    assert [k["name"] for k in card["sidecar"]["knownReleases"]] == ["4def7c5", "a66ff6f", "31be5db"]
    for sc in (asc, psc, dsc):  # one warning naming an untested release, none for a known one
        untested = [line for line in sc.proc.lines if "schema release untested" in line]
        assert len(untested) == (0 if form == "source" else 1), sc.proc.lines
        assert form == "source" or card["schema"]["release"] in untested[0]
    for sc in (psc, dsc):  # a schema without handoff_profile: derived, with its warning
        derived = [line for line in sc.proc.lines if "advertises no handoff_profile" in line]
        assert len(derived) == (1 if schema == "4def7c5" else 0), sc.proc.lines

    # aggregated, then the same request disaggregated: the same tokens
    async with open_sidecar(asc.ws) as client, client.generate(request) as ref:
        reference = [e async for e in ref]
    assert ref.end is not None and ref.end.outcome == "completed"
    argv = [sys.executable, "-m", "sidecar", "disagg", "--json", "--max-tokens", "6", PROMPT]
    done = await trio.run_process(
        [*argv, "--prefill", psc.ws, "--decode", dsc.ws],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr.decode()
    lines = [json.loads(line) for line in done.stdout.decode().splitlines()]
    end = lines[-1]
    assert (end["type"], end["outcome"]) == ("end", "completed"), end
    assert end["mode"] == ("bootstrap" if flavor == "sglang" and schema != "4def7c5" else "context_first")
    tokens = [
        t["tokenId"]
        for line in lines
        if line.get("phase") == "decode" and "token" in line.get("response", {})
        for t in line["response"]["token"]["tokens"]
    ]
    assert tokens == token_ids(reference) and tokens

    # SIGTERM: the admitted stream finishes; the engine's Drain where the schema has it
    async with open_sidecar(asc.ws) as client:
        async with client.generate(generate_request(max_tokens=30, requestId="inflight")) as s:
            async for _ in s:
                break
            asc.proc.signal(signal.SIGTERM)
            end = await s.wait_end()
    assert end.outcome == "completed"
    assert await asc.proc.wait(timeout=15) == 0
    log = "\n".join(asc.proc.lines)
    if DRAIN[schema]:
        assert "engine drain: DRAIN_STATE_STARTED" in log
    elif form == "source":  # known to have no Drain: not even asked
        assert f"engine schema {schema} has no Drain RPC; draining locally only" in log
    else:  # untested: asked, UNIMPLEMENTED
        assert "engine has no Drain RPC; draining locally only" in log
    assert re.search("drained", log)
