"""The sidecar's OpenAI front against stock vLLM's own OpenAI server, on the same tiny model.

Two paths to the same vLLM build: ``vllm serve`` (the reference), and ``vllm-engine`` (stock vLLM
behind OpenEngine) with the sidecar's front before it. The same requests — completions and chat,
greedy, several stop conditions, ``n`` > 1 (seeded), logprobs, streamed and not — must give the
same text, token counts, finish reasons and stop reasons, and the same errors by status; the GIE
gauges must have stock vLLM's names and types. The differences that must exist are in
docs/OPENAI.md.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import trio

from sidecar.childproc import OPENAI_READY
from tests.e2e.harness import sidecar
from tests.vllm.harness import MODEL, VllmProc, VllmServe, start_vllm_serve

PROMPT = "Bakeno dafi, and the bakeno is"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Bakeno dafi?"}]


@pytest.fixture(scope="module")
def vllm_serve(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServe]:
    serve = start_vllm_serve(tiny_model, tmp_path_factory.mktemp("vllm-serve"))
    try:
        yield serve
    finally:
        serve.stop()


def _client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)


def _completion(r: Any) -> Any:
    return (
        [
            (c.index, c.text, c.finish_reason, (c.model_extra or {}).get("stop_reason"), _lp(c.logprobs))
            for c in sorted(r.choices, key=lambda c: c.index)
        ],
        (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens),
    )


def _lp(logprobs: Any) -> Any:
    """The tokens and their logprobs (rounded: two processes' float sums may differ in the last bits)."""
    if logprobs is None:
        return None
    if hasattr(logprobs, "content"):
        return [
            (t.token, round(t.logprob, 3), sorted(x.token for x in t.top_logprobs)) for t in logprobs.content
        ]
    return list(zip(logprobs.tokens, [round(x, 3) for x in logprobs.token_logprobs], strict=True))


def _chat(r: Any) -> Any:
    return (
        [
            (
                c.index,
                c.message.content,
                c.finish_reason,
                (c.model_extra or {}).get("stop_reason"),
                _lp(c.logprobs),
            )
            for c in sorted(r.choices, key=lambda c: c.index)
        ],
        (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens),
    )


async def _streamed(c: openai.AsyncOpenAI, chat: bool, **kw: Any) -> Any:
    """Text per choice, finish reasons and usage of a streamed request."""
    create = c.chat.completions.create if chat else c.completions.create
    stream = await create(model=MODEL, stream=True, stream_options={"include_usage": True}, **kw)
    text: dict[int, str] = {}
    finish: dict[int, str | None] = {}
    usage = None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = (chunk.usage.prompt_tokens, chunk.usage.completion_tokens, chunk.usage.total_tokens)
        for ch in chunk.choices:
            piece = ch.delta.content if chat else ch.text
            text[ch.index] = text.get(ch.index, "") + (piece or "")
            if ch.finish_reason is not None:
                finish[ch.index] = ch.finish_reason
    return sorted(text.items()), sorted(finish.items()), usage


async def test_the_front_answers_as_vllm_serve_does(
    aio_loop: Any, vllm_engine: VllmProc, vllm_serve: VllmServe
) -> None:
    with trio.fail_after(600):
        async with sidecar(vllm_engine.address, "--no-kv-events", "--openai-listen", "127.0.0.1:0") as sc:
            ours = _client((await sc.proc.wait_for_line(OPENAI_READY)).group(1))
            ref = _client(vllm_serve.url)
            # the greedy text picks the stop strings: a word in the middle of it, and two of them
            base = await ref.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
            words = base.choices[0].text.split()
            assert len(words) >= 4, base.choices[0].text
            completions: list[dict[str, Any]] = [
                {"max_tokens": 24, "temperature": 0},
                {"max_tokens": 24, "temperature": 0, "stop": [words[2]]},
                {"max_tokens": 24, "temperature": 0, "stop": [words[3], words[1]]},
                {
                    "max_tokens": 24,
                    "temperature": 0,
                    "stop": [words[2]],
                    "extra_body": {"include_stop_str_in_output": True},
                },
                {"max_tokens": 24, "temperature": 0, "extra_body": {"min_tokens": 20, "stop": [words[1]]}},
                {"max_tokens": 16, "temperature": 0, "logprobs": 3},
                {"max_tokens": 12, "temperature": 0.8, "seed": 7, "n": 3},
            ]
            for kw in completions:
                a = _completion(await ref.completions.create(model=MODEL, prompt=PROMPT, **kw))
                b = _completion(await ours.completions.create(model=MODEL, prompt=PROMPT, **kw))
                assert b == a, kw
            ids = [5, 17, 300, 1200, 9]
            a = _completion(
                await ref.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
            )
            b = _completion(
                await ours.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
            )
            assert b == a
            chats: list[dict[str, Any]] = [
                {"max_completion_tokens": 16, "temperature": 0},
                {"max_tokens": 16, "temperature": 0, "stop": [words[0][:2]]},
                {"max_completion_tokens": 12, "temperature": 0, "logprobs": True, "top_logprobs": 2},
                {"max_completion_tokens": 10, "temperature": 0.8, "seed": 11, "n": 2},
            ]
            for kw in chats:
                a = _chat(await ref.chat.completions.create(model=MODEL, messages=MESSAGES, **kw))  # type: ignore[arg-type]
                b = _chat(await ours.chat.completions.create(model=MODEL, messages=MESSAGES, **kw))  # type: ignore[arg-type]
                assert b == a, kw
            # streamed: the same text, finish reasons and usage
            for chat, kw in (
                (False, {"prompt": PROMPT, "max_tokens": 20, "temperature": 0, "stop": [words[3]]}),
                (False, {"prompt": PROMPT, "max_tokens": 10, "temperature": 0.8, "seed": 3, "n": 2}),
                (True, {"messages": MESSAGES, "max_tokens": 14, "temperature": 0}),
            ):
                assert await _streamed(ours, chat, **kw) == await _streamed(ref, chat, **kw), kw
            # the same errors, by status
            for bad in ({"model": "nope", "prompt": "x"}, {"model": MODEL, "prompt": "x", "max_tokens": 0}):
                statuses = []
                for c in (ref, ours):
                    with pytest.raises(openai.APIStatusError) as err:
                        await c.completions.create(**bad)
                    statuses.append(err.value.status_code)
                assert statuses[0] == statuses[1], (bad, statuses)
            await ours.close()
            await ref.close()


GAUGES = (
    "vllm:num_requests_waiting",
    "vllm:num_requests_running",
    "vllm:kv_cache_usage_perc",
    "vllm:cache_config_info",
)


def _types(text: str) -> dict[str, str]:
    return dict(re.findall(r"^# TYPE (vllm:\S+) (\S+)$", text, re.M))


async def test_the_gie_gauges_have_stock_vllms_names_and_types(
    aio_loop: Any, vllm_engine: VllmProc, vllm_serve: VllmServe
) -> None:
    with trio.fail_after(120):
        async with (
            sidecar(vllm_engine.address, "--no-kv-events", "--openai-listen", "127.0.0.1:0") as sc,
            httpx.AsyncClient() as http,
        ):
            base = (await sc.proc.wait_for_line(OPENAI_READY)).group(1).removesuffix("/v1")
            ours = (await http.get(base + "/metrics")).text
            ref = (await http.get(vllm_serve.url.removesuffix("/v1") + "/metrics")).text
    theirs, mine = _types(ref), _types(ours)
    assert (
        {g: mine.get(g) for g in GAUGES}
        == {g: theirs.get(g) for g in GAUGES}
        == dict.fromkeys(GAUGES, "gauge")
    )
    for gauge in GAUGES[:3]:  # the same labels on the load gauges
        assert re.search(rf'^{gauge}\{{engine="0",model_name="{MODEL}"\}} ', ours, re.M), gauge
        assert re.search(rf'^{gauge}\{{engine="0",model_name="{MODEL}"\}} ', ref, re.M), gauge
    for text in (ours, ref):
        assert re.search(
            r'^vllm:cache_config_info\{[^}]*block_size="32"[^}]*num_gpu_blocks="2048"', text, re.M
        )
