"""Generation end to end over gRPC (in-process engines, real sockets, the EngineClient)."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from sidecar.mock import tokenizer as tok
from sidecar.openengine import pb
from sidecar.openengine.engine_errors import EngineStatusError
from tests.polling import eventually

from .helpers import (
    collect,
    counters,
    engine,
    final_usage,
    finishes,
    kind,
    load_is,
    request,
    text,
    token_ids,
)

FLAVORS = ["trtllm", "vllm", "sglang"]


@pytest.mark.parametrize("flavor", FLAVORS)
async def test_aggregated_stream_shape_and_usage(aio_loop: Any, flavor: str) -> None:
    async with engine(flavor=flavor) as (_, client):
        events = await collect(
            client, request(max_tokens=6, stopping=pb.StoppingOptions(max_tokens=6, ignore_eos=True))
        )
        assert [kind(e) for e in events] == ["token"] * 6 + ["finished"]
        assert all(e.request_id == "r1" for e in events)
        assert finishes(events)[0].reason == pb.FinishReason.LENGTH
        usage = final_usage(events)
        prompt = [tok.BOS_ID, *tok.encode("hello world")]
        assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
            len(prompt),
            6,
            len(prompt) + 6,
        )
        assert usage.cached_prompt_tokens == 0
        attrs = await counters(client)
        assert (attrs["requests_accepted"], attrs["requests_completed"], attrs["streams_open"]) == (1, 1, 0)


async def test_same_request_same_tokens_across_engines(aio_loop: Any) -> None:
    req = request(max_tokens=40, sampling=pb.SamplingParams(seed=7))
    async with engine(flavor="vllm") as (_, a):
        first = await collect(a, req)
        again = await collect(a, request("r2", max_tokens=40, sampling=pb.SamplingParams(seed=7)))
    async with engine(flavor="trtllm") as (_, b):
        other = await collect(b, req)
    assert token_ids(first) == token_ids(again) == token_ids(other)
    assert text(first) == tok.decode(token_ids(first))
    async with engine(flavor="vllm", seed=1) as (_, c):
        assert token_ids(await collect(c, req)) != token_ids(first)


async def test_natural_eos_and_stop_match(aio_loop: Any) -> None:
    async with engine() as (_, client):
        events = await collect(client, request(max_tokens=None))
        done = finishes(events)[0]
        assert done.reason == pb.FinishReason.STOP and done.stop_match == pb.StopMatch(
            eos_token_id=tok.EOS_ID
        )
        assert token_ids(events)[-1] == tok.EOS_ID
        full = text(events)
        stop = full[8:12]
        stopped = await collect(
            client,
            request(
                "r2",
                max_tokens=None,
                stopping=pb.StoppingOptions(conditions=[pb.StopCondition(stop_text=stop)]),
            ),
        )
        assert text(stopped) == full[: full.index(stop)]
        assert finishes(stopped)[0].stop_match == pb.StopMatch(stop_text=stop)
        target = token_ids(events)[3]
        by_id = await collect(
            client,
            request(
                "r3",
                max_tokens=None,
                stopping=pb.StoppingOptions(conditions=[pb.StopCondition(stop_token_id=target)]),
            ),
        )
        assert token_ids(by_id)[-1] == target
        assert finishes(by_id)[0].stop_match == pb.StopMatch(stop_token_id=target)
        assert final_usage(by_id).completion_tokens == len(token_ids(by_id))


async def test_min_tokens_and_ignore_eos(aio_loop: Any) -> None:
    async with engine() as (_, client):
        natural = len(token_ids(await collect(client, request(max_tokens=None))))
        longer = await collect(
            client, request("r2", max_tokens=None, stopping=pb.StoppingOptions(min_tokens=natural + 5))
        )
        assert len(token_ids(longer)) == natural + 6
        ignore = await collect(
            client, request("r3", stopping=pb.StoppingOptions(max_tokens=natural + 20, ignore_eos=True))
        )
        assert len(token_ids(ignore)) == natural + 20 and tok.EOS_ID not in token_ids(ignore)


async def test_num_sequences_interleaved_each_with_its_finish(aio_loop: Any) -> None:
    async with engine() as (_, client):
        req = request(max_tokens=None, sampling=pb.SamplingParams(num_sequences=3, seed=3))
        events = await collect(client, req)
        indexes = [e.token.output_index for e in events if e.token is not None]
        assert indexes[:3] == [0, 1, 2]
        done = finishes(events)
        assert sorted(done) == [0, 1, 2]
        for i in range(3):
            last_token = max(
                k for k, e in enumerate(events) if e.token is not None and e.token.output_index == i
            )
            finish_at = next(
                k for k, e in enumerate(events) if e.finished is not None and e.finished.output_index == i
            )
            assert finish_at == last_token + 1
        assert len({tuple(token_ids(events, i)) for i in range(3)}) == 3
        usage = final_usage(events)
        assert usage.completion_tokens == sum(len(token_ids(events, i)) for i in range(3))
        greedy = await collect(
            client, request("r2", max_tokens=5, sampling=pb.SamplingParams(num_sequences=2, temperature=0))
        )
        assert token_ids(greedy, 0) == token_ids(greedy, 1)


async def test_logprobs_and_prompt_output(aio_loop: Any) -> None:
    async with engine() as (_, client):
        req = request(
            max_tokens=4,
            response=pb.ResponseOptions(
                return_prompt_logprobs=True,
                prompt_candidates=pb.CandidateTokenSelection(top_n=2),
                return_output_logprobs=True,
                output_candidates=pb.CandidateTokenSelection(top_n=3),
            ),
        )
        events = await collect(client, req)
        assert kind(events[0]) == "prompt" and [kind(e) for e in events[1:]].count("prompt") == 0
        prompt = events[0].prompt
        assert prompt is not None
        assert [t.token_id for t in prompt.tokens] == [tok.BOS_ID, *tok.encode("hello world")]
        first, second = prompt.tokens[0], prompt.tokens[1]
        assert first.logprob is None and first.rank is None and first.candidates == []
        assert second.logprob is not None and len(second.candidates) == 2
        for e in events:
            if e.token is not None:
                [info] = e.token.tokens
                assert info.logprob is not None and info.rank is not None and len(info.candidates) == 3
                assert info.token == tok.token_text(info.token_id)
        start = await collect(
            client,
            request(
                "r2",
                max_tokens=1,
                response=pb.ResponseOptions(return_prompt_logprobs=True, prompt_logprob_start=2),
            ),
        )
        assert start[0].prompt is not None and len(start[0].prompt.tokens) == len(prompt.tokens) - 2


async def test_prefix_cache_reports_cached_prompt_tokens(aio_loop: Any) -> None:
    prompt = " ba" * 40  # 41 tokens with BOS: two full blocks of 16 plus a tail
    async with engine(kv_block_size=16) as (_, client):
        first = final_usage(await collect(client, request("a", prompt=prompt, max_tokens=2)))
        second = final_usage(await collect(client, request("b", prompt=prompt, max_tokens=2)))
        assert (first.cached_prompt_tokens, second.cached_prompt_tokens) == (0, 32)
        salted = final_usage(
            await collect(client, request("c", prompt=prompt, max_tokens=2, kv=pb.KvOptions(cache_salt="t")))
        )
        assert salted.cached_prompt_tokens == 0
        bypass = final_usage(
            await collect(
                client, request("d", prompt=prompt, max_tokens=2, kv=pb.KvOptions(bypass_prefix_cache=True))
            )
        )
        assert bypass.cached_prompt_tokens == 0


async def test_guided_choice(aio_loop: Any) -> None:
    async with engine() as (_, client):
        events = await collect(
            client,
            request(
                max_tokens=None, guided=pb.GuidedDecoding(choice=pb.ChoiceConstraint(choices=["yes", "no"]))
            ),
        )
        assert text(events) in ("yes", "no")


async def test_token_ids_input_and_media(aio_loop: Any) -> None:
    async with engine(flavor="sglang") as (_, client):
        req = pb.GenerateRequest(
            request_id="m",
            token_ids=pb.TokenIds(ids=[tok.BOS_ID, tok.IMAGE_ID, *tok.encode(" ba")]),
            media=[pb.MediaItem(modality=pb.Modality.IMAGE, url="https://example.com/cat.png")],
            stopping=pb.StoppingOptions(max_tokens=2),
        )
        assert final_usage(await collect(client, req)).prompt_tokens == 1 + 8 + 1


async def test_metadata_routes_and_is_validated(aio_loop: Any) -> None:
    async with engine(dp_size=3) as (_, client):
        md = {
            "openengine-target-dp-rank": "2",
            "openengine-routing-key": "tenant",
            "traceparent": "00-1-2-01",
        }
        await collect(client, request("a"), metadata=md)
        await collect(client, request("b"), metadata={"openengine-target-dp-rank": "2"})
        attrs = await counters(client)
        assert attrs["served_by_rank"] == {"0": 0, "1": 0, "2": 2}
        assert attrs["recent_requests"]["a"]["metadata"] == md and attrs["recent_requests"]["a"]["rank"] == 2
        for bad in (
            {"openengine-target-dp-rank": "3"},
            {"openengine-target-dp-rank": "one"},
            {"openengine-priority": "high"},
            [("openengine-priority", "1"), ("openengine-priority", "2")],
        ):
            with pytest.raises(EngineStatusError) as info:
                await collect(client, request("bad"), metadata=bad)
            assert info.value.status == "INVALID_ARGUMENT"
        attrs = await counters(client)
        assert attrs["rejected_by_status"] == {"INVALID_ARGUMENT": 4}
        assert attrs["requests_accepted"] == 2


async def test_least_loaded_rank_without_target(aio_loop: Any) -> None:
    async with engine(dp_size=2, token_delay_ms=50) as (_, client):
        async with trio.open_nursery() as nursery:
            for rid in ("a", "b"):
                nursery.start_soon(collect, client, request(rid, max_tokens=3))
        attrs = await counters(client)
        assert attrs["served_by_rank"] == {"0": 1, "1": 1}


@pytest.mark.parametrize("flavor", FLAVORS)
@pytest.mark.parametrize(
    ("role", "session", "status"),
    [
        ("aggregated", pb.KvSessionRef(session_id="s", handoff_profile="x"), "FAILED_PRECONDITION"),
        ("decode", None, "FAILED_PRECONDITION"),
    ],
)
async def test_role_mismatch_is_a_status(
    aio_loop: Any, flavor: str, role: str, session: pb.KvSessionRef | None, status: str
) -> None:
    async with engine(flavor=flavor, role=role) as (_, client):
        with pytest.raises(EngineStatusError) as info:
            await collect(client, request(kv=pb.KvOptions(session=session) if session else None))
        assert info.value.status == status
        attrs = await counters(client)
        assert attrs["requests_accepted"] == 0 and attrs["rejected_by_status"] == {status: 1}


async def test_first_token_delay(aio_loop: Any) -> None:
    async with engine(first_token_delay_ms=100) as (_, client):
        start = trio.current_time()
        async with client.generate(request(max_tokens=2)) as stream:
            await stream.__anext__()
            assert trio.current_time() - start >= 0.1
            [e async for e in stream]


async def test_duplicate_and_generated_request_ids(aio_loop: Any) -> None:
    async with engine(token_delay_ms=20) as (_, client):
        async with client.generate(request("dup", max_tokens=50)) as stream:
            await stream.__anext__()
            with pytest.raises(EngineStatusError) as info:
                await collect(client, request("dup"))
            assert info.value.status == "ALREADY_EXISTS"
        events = await collect(client, request("", max_tokens=2))
        assert events[0].request_id.startswith("mock-")


async def test_admission_queue_and_overload(aio_loop: Any) -> None:
    async with (
        engine(max_running=1, max_queue=1, token_delay_ms=10) as (_, client),
        client.generate(request("run", max_tokens=200)) as running,
    ):
        await running.__anext__()
        async with client.generate(request("queued", max_tokens=2)) as queued:
            await eventually(lambda: load_is(client, lambda load: load.queued_requests == 1))
            with pytest.raises(EngineStatusError) as info:
                await collect(client, request("over"))
            assert info.value.status == "RESOURCE_EXHAUSTED"
            load = await client.get_load()
            assert (load.running_requests, load.queued_requests) == (1, 1)
            assert load.ranks[0].queued_requests == 1
            await client.abort(pb.AbortRequest(request_id="run"))
            events = [e async for e in queued]
            assert finishes(events)[0].reason == pb.FinishReason.LENGTH


async def test_priority_orders_the_queue(aio_loop: Any) -> None:
    order: list[str] = []
    async with engine(max_running=1, max_queue=4, token_delay_ms=5) as (_, client):

        async def run(rid: str, prio: str) -> None:
            await collect(client, request(rid, max_tokens=1), metadata={"openengine-priority": prio})
            order.append(rid)

        async with client.generate(request("first", max_tokens=30)) as first:
            await first.__anext__()
            async with trio.open_nursery() as nursery:
                for rid, prio in (("low", "-1"), ("high", "9")):
                    nursery.start_soon(run, rid, prio)
                await eventually(lambda: load_is(client, lambda load: load.queued_requests == 2))
                async for _ in first:
                    pass
        assert order == ["high", "low"]


async def test_per_request_token_delay_and_model_info(aio_loop: Any) -> None:
    async with engine(aliases=("small",)) as (_, client):
        mi = await client.get_model_info("small")
        assert mi.served_model_name == "Qwen/Qwen3-0.6B"
        with pytest.raises(EngineStatusError) as info:
            await client.get_model_info("nope")
        assert info.value.status == "NOT_FOUND"
        extra = pb.Struct.from_dict({"mock": {"token_delay_ms": 30}})
        start = trio.current_time()
        await collect(client, request(max_tokens=3, model="small", extra=extra))
        assert trio.current_time() - start >= 0.09
