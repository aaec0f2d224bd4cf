"""The adapter's request mapping against real vLLM, through a direct ``EngineClient`` (no sidecar).

What vLLM cannot do is refused before acceptance with a typed status and no event; what it can
do is mapped onto vLLM's own options and comes back under the stream rules: logprobs with
top-n candidates, prompt logprobs from a start position, stop strings (``stop_match``), guided
decoding by choice, two outputs.
"""

from __future__ import annotations

import zlib
from typing import Any

import pytest
import trio

from sidecar.openengine import pb
from sidecar.openengine.client import open_engine_client
from sidecar.openengine.engine_errors import EngineStatusError
from tests.polling import eventually
from tests.real_engines import engine_load, token_ids
from tests.vllm.harness import MAX_MODEL_LEN, MODEL, VllmProc, wait_request_gone


def req(rid: str, max_tokens: int = 6, *, ignore_eos: bool = True, **fields: Any) -> pb.GenerateRequest:
    """A request on a 24-token prompt of its own (seeded by the id)."""
    fields.setdefault("token_ids", pb.TokenIds(ids=token_ids(zlib.crc32(rid.encode()), 24)))
    stopping = pb.StoppingOptions(max_tokens=max_tokens, ignore_eos=ignore_eos)
    return pb.GenerateRequest(request_id=rid, model=MODEL, stopping=stopping, **fields)


async def events_of(
    address: str, request: pb.GenerateRequest, metadata: Any = None
) -> list[pb.GenerateResponse]:
    async with open_engine_client(address) as client:
        with trio.fail_after(60):
            async with client.generate(request, metadata=metadata) as stream:
                return [event async for event in stream]


REFUSED = [
    (
        "media",
        req("r-media", media=[pb.MediaItem(modality=pb.Modality.IMAGE, url="http://x/a.png")]),
        "UNIMPLEMENTED",
    ),
    ("lora", req("r-lora", lora_name="adapter"), "FAILED_PRECONDITION"),
    (
        "kv-session",
        req("r-kv", kv=pb.KvOptions(session=pb.KvSessionRef(session_id="s"))),
        "FAILED_PRECONDITION",
    ),
    ("unknown-model", pb.GenerateRequest(request_id="r-model", model="nope", prompt="hi"), "NOT_FOUND"),
    ("no-input", pb.GenerateRequest(request_id="r-none", model=MODEL), "INVALID_ARGUMENT"),
    ("vocab", req("r-vocab", token_ids=pb.TokenIds(ids=[5, 99999])), "INVALID_ARGUMENT"),
    ("n-zero", req("r-n0", sampling=pb.SamplingParams(num_sequences=0)), "INVALID_ARGUMENT"),
    ("top-p", req("r-topp", sampling=pb.SamplingParams(top_p=1.5)), "INVALID_ARGUMENT"),
    (
        "all-candidates",
        req(
            "r-all",
            response=pb.ResponseOptions(
                return_output_logprobs=True,
                output_candidates=pb.CandidateTokenSelection(all=pb.AllCandidates()),
            ),
        ),
        "UNIMPLEMENTED",
    ),
    (
        "structural-tag",
        req("r-tag", guided=pb.GuidedDecoding(structural_tag='{"type": "structural_tag"}')),
        "UNIMPLEMENTED",
    ),
    ("too-long", req("r-long", token_ids=pb.TokenIds(ids=token_ids(5, MAX_MODEL_LEN))), "INVALID_ARGUMENT"),
]


@pytest.mark.parametrize(("label", "request_", "status"), REFUSED, ids=[r[0] for r in REFUSED])
async def test_refused_before_acceptance(
    aio_loop: Any, vllm_engine: VllmProc, label: str, request_: pb.GenerateRequest, status: str
) -> None:
    with pytest.raises(EngineStatusError) as err:
        await events_of(vllm_engine.address, request_)
    assert err.value.status == status, err.value


async def test_priority_needs_the_priority_policy(aio_loop: Any, vllm_engine: VllmProc) -> None:
    with pytest.raises(EngineStatusError) as err:
        await events_of(vllm_engine.address, req("r-prio"), metadata=[("openengine-priority", "5")])
    assert err.value.status == "UNIMPLEMENTED"


async def test_logprobs_stop_text_choice_and_two_outputs(aio_loop: Any, vllm_engine: VllmProc) -> None:
    address = vllm_engine.address
    # output logprobs with two candidates, prompt logprobs from position 20 of 24
    response = pb.ResponseOptions(
        return_output_logprobs=True,
        output_candidates=pb.CandidateTokenSelection(top_n=2),
        return_prompt_logprobs=True,
        prompt_logprob_start=20,
    )
    events = await events_of(
        address, req("lp-1", response=response, sampling=pb.SamplingParams(temperature=0.0))
    )
    prompt = [e.prompt for e in events if e.prompt is not None]
    assert len(prompt) == 1 and len(prompt[0].tokens) == 4 and events[0].prompt is not None
    assert all(t.logprob is not None for t in prompt[0].tokens)
    tokens = [t for e in events if e.token is not None for t in e.token.tokens]
    assert len(tokens) == 6
    for t in tokens:
        assert t.logprob is not None and t.rank == 1  # greedy: the chosen token ranks first
        assert [c.rank for c in t.candidates] == [1, 2] and t.candidates[0].token_id == t.token_id

    # a stop string: vLLM stops on it, the finish names it
    first = await events_of(address, req("stop-ref", 20, sampling=pb.SamplingParams(temperature=0.0)))
    text = "".join(e.token.text for e in first if e.token is not None)
    half = text[len(text) // 2 :]
    stop = next(
        half[i : i + 2]
        for i in range(len(half) - 1)
        if half[i : i + 2].isprintable() and half[i : i + 2].strip()
    )
    stopping = pb.StoppingOptions(
        max_tokens=20, ignore_eos=True, conditions=[pb.StopCondition(stop_text=stop)]
    )
    same = req("stop-ref").token_ids
    events = await events_of(
        address,
        pb.GenerateRequest(
            request_id="stop-1",
            model=MODEL,
            token_ids=same,
            sampling=pb.SamplingParams(temperature=0.0),
            stopping=stopping,
        ),
    )
    finished = events[-1].finished
    assert finished is not None and finished.reason == pb.FinishReason.STOP
    assert finished.stop_match is not None and finished.stop_match.stop_text == stop
    assert events[-1].usage is not None and events[-1].usage.completion_tokens < 20

    # guided decoding by choice: the text is one of the choices
    choices = ["alpha", "beta gamma"]
    events = await events_of(
        address,
        req(
            "choice-1",
            16,
            ignore_eos=False,
            guided=pb.GuidedDecoding(choice=pb.ChoiceConstraint(choices=choices)),
        ),
    )
    assert "".join(e.token.text for e in events if e.token is not None) in choices
    assert events[-1].finished is not None and events[-1].finished.reason == pb.FinishReason.STOP

    # two outputs: each finishes once, Usage only on the last event
    events = await events_of(
        address, req("two-1", 4, sampling=pb.SamplingParams(num_sequences=2, temperature=1.0, seed=3))
    )
    assert sorted(e.finished.output_index for e in events if e.finished is not None) == [0, 1]
    assert [e.usage is not None for e in events] == [False] * (len(events) - 1) + [True]
    assert events[-1].usage is not None and events[-1].usage.completion_tokens == 8


async def test_abort_after_vllm_finished_an_unread_request_cuts_its_stream(
    aio_loop: Any, vllm_engine: VllmProc
) -> None:
    """vLLM runs ahead of a client that does not read: it can finish a request whose events still
    wait in the adapter (HTTP/2 flow control). An Abort then answers ABORTED, so the stream must
    end there (``CANCELLED``), not deliver the rest of the tokens and a ``LENGTH`` finish."""
    rid = "abort-unread-1"
    # per-token logprobs with 8 candidates: far more than the 64 KiB stream window unread
    response = pb.ResponseOptions(
        return_output_logprobs=True, output_candidates=pb.CandidateTokenSelection(top_n=8)
    )
    request = req(rid, 1500, response=response)
    async with open_engine_client(vllm_engine.address) as client:
        with trio.fail_after(120):
            async with client.generate(request) as stream:
                first = await stream.__anext__()
                assert first.token is not None, first

                async def held_after_vllm_finished() -> pb.LoadInfo | None:
                    load = await engine_load(vllm_engine.address)
                    attrs = load.attributes.to_dict() if load.attributes is not None else {}
                    finished = attrs["vllm_unfinished_requests"] == 0 and attrs["vllm_running"] == 0
                    return load if finished and attrs["in_flight"] == 1 else None

                load = await eventually(held_after_vllm_finished, 60, interval=0.05)
                # GetLoad still counts it (as Abort and Drain do), although vLLM's stats no longer do
                assert (load.running_requests, load.queued_requests) == (1, 0), load
                reply = await client.abort(pb.AbortRequest(request_id=rid))
                assert reply.status == pb.AbortStatus.ABORTED, reply
                rest = [event async for event in stream]
    tokens = len(first.token.tokens) + sum(len(e.token.tokens) for e in rest if e.token is not None)
    finished = rest[-1].finished
    assert finished is not None and finished.reason == pb.FinishReason.CANCELLED, (finished, tokens)
    assert tokens < 1500 and rest[-1].usage is not None
    assert rest[-1].usage.completion_tokens == tokens
    await wait_request_gone(vllm_engine.address)
