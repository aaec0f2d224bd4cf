"""The OpenAI front end to end with the real ``openai`` client: a simulated engine and the sidecar
as real processes (``run --openai-listen``).

Completions and chat, streamed and not; errors raised as the client's typed exceptions; a LoRA
adapter as the ``model``; request ids and trace context reaching the engine; a client that
leaves mid-stream gets its stream aborted in the engine; drain finishes what was admitted and
answers new requests 503; the GIE gauges on the front's own ``/metrics``; TLS and a bearer token.
"""

from __future__ import annotations

import json
import re
import signal
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import trio
import trustme

from sidecar.childproc import OPENAI_READY, loopback_run_args
from sidecar.client.sidecar_client import open_sidecar
from sidecar.mock.tokenizer import CHAT_TEMPLATE
from tests.e2e.harness import (
    Sidecar,
    counters_once_aborted,
    engine_counters,
    eventually,
    mock_engine,
    sidecar,
    spawn,
    wait_engine_idle,
)

MODEL = "Qwen/Qwen3-0.6B"
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


async def openai_url(sc: Sidecar) -> str:
    return (await sc.proc.wait_for_line(OPENAI_READY)).group(1)


def client(url: str, **kw: Any) -> openai.AsyncOpenAI:
    """The real client, no retries (a 429 or 503 is what a test looks at)."""
    return openai.AsyncOpenAI(base_url=url, api_key=kw.pop("api_key", "unused"), max_retries=0, **kw)


@asynccontextmanager
async def front(tmp_path: Path, *engine_args: str, sidecar_args: tuple[str, ...] = ()) -> AsyncIterator[Any]:
    """(engine, sidecar, OpenAI base URL): the mock engine with the mock tokenizer's chat template."""
    template = tmp_path / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    async with (
        mock_engine(tmp_path, "--flavor", "vllm", *engine_args) as engine,
        sidecar(
            engine.address,
            "--no-kv-events",
            "--openai-listen",
            "127.0.0.1:0",
            "--chat-template",
            str(template),
            *sidecar_args,
        ) as sc,
    ):
        yield engine, sc, await openai_url(sc)


async def test_completions_and_chat_streamed_and_not(aio_loop: Any, tmp_path: Path) -> None:
    with trio.fail_after(60):
        async with front(tmp_path) as (engine, _, url):
            c = client(url)
            models = [m.id async for m in c.models.list()]
            assert models == [MODEL]
            # not streamed: one choice per output, usage, logprobs, request id and trace context
            raw = await c.completions.with_raw_response.create(
                model=MODEL,
                prompt="Hello world",
                max_tokens=6,
                n=2,
                logprobs=2,
                extra_headers={"X-Request-Id": "oai-complete-1", "traceparent": TRACEPARENT},
                extra_body={"ignore_eos": True},
            )
            assert raw.headers["x-request-id"] == "oai-complete-1"
            r = raw.parse()
            assert r.id == "cmpl-oai-complete-1" and r.model == MODEL
            assert sorted(ch.index for ch in r.choices) == [0, 1]
            assert all(ch.finish_reason == "length" and ch.text for ch in r.choices)
            assert all(len(ch.logprobs.tokens) == 6 for ch in r.choices if ch.logprobs)
            assert "".join(r.choices[0].logprobs.tokens) == r.choices[0].text  # type: ignore[union-attr]
            assert (r.usage.completion_tokens, r.usage.total_tokens - r.usage.prompt_tokens) == (12, 12)
            seen = (await engine_counters(engine.address))["recent_requests"]["oai-complete-1"]
            assert seen["metadata"]["traceparent"] == TRACEPARENT
            # streamed, with the usage chunk last
            stream = await c.completions.create(
                model=MODEL,
                prompt="Hello world",
                max_tokens=5,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            chunks = [ch async for ch in stream]
            assert (
                "".join(ch.choices[0].text for ch in chunks if ch.choices)
                == r.choices[0].text[: len("".join(ch.choices[0].text for ch in chunks if ch.choices))]
            )
            assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
            assert chunks[-1].choices == [] and chunks[-1].usage is not None
            assert chunks[-1].usage.completion_tokens == 5
            # chat, both ways: the same greedy text
            messages = [{"role": "user", "content": "Say hello"}]
            whole = await c.chat.completions.create(
                model=MODEL, messages=messages, max_completion_tokens=8, temperature=0, seed=3
            )
            text = whole.choices[0].message.content
            assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant" and text
            parts = await c.chat.completions.create(
                model=MODEL, messages=messages, max_completion_tokens=8, temperature=0, seed=3, stream=True
            )
            deltas = [ch.choices[0].delta async for ch in parts]
            assert deltas[0].role == "assistant"
            assert "".join(d.content or "" for d in deltas) == text
            # a stop string ends the output with finish_reason stop and vLLM's stop_reason
            stop = text.split()[1] if len(text.split()) > 1 else text.strip()
            stopped = await c.chat.completions.create(
                model=MODEL, messages=messages, max_completion_tokens=8, temperature=0, seed=3, stop=[stop]
            )
            choice = stopped.choices[0]
            assert choice.finish_reason == "stop" and stop not in (choice.message.content or "")
            assert choice.model_extra is not None and choice.model_extra.get("stop_reason") == stop
            await c.close()
            await wait_engine_idle(engine.address)


async def test_errors_are_the_clients_typed_exceptions(aio_loop: Any, tmp_path: Path) -> None:
    with trio.fail_after(60):
        async with front(tmp_path) as (engine, sc, url):
            c = client(url)
            with pytest.raises(openai.NotFoundError) as nf:
                await c.completions.create(model="nope", prompt="x")
            assert nf.value.code == "model_not_found"
            with pytest.raises(openai.BadRequestError) as bad:
                await c.completions.create(model=MODEL, prompt="x", temperature="hot")  # type: ignore[arg-type]
            assert bad.value.param == "temperature"
            video = [{"type": "video_url", "video_url": {"url": "http://media.example/v.mp4"}}]
            with pytest.raises(openai.BadRequestError, match="video"):  # the vLLM flavour takes images only
                await c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": video}])  # type: ignore[list-item]
            with pytest.raises(openai.BadRequestError, match="max_num_sequences"):
                await c.completions.create(model=MODEL, prompt="x", n=64)
            with pytest.raises(openai.NotFoundError):
                await c.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
            counters = await engine_counters(engine.address)
            assert counters["requests_accepted"] == 0  # nothing refused here reached the engine
            await c.close()
        # without a chat template, chat is refused naming the flag; at the stream limit, 429
        async with (
            mock_engine(tmp_path, name="bare") as engine,
            sidecar(
                engine.address, "--no-kv-events", "--openai-listen", "127.0.0.1:0", "--max-streams", "0"
            ) as sc,
        ):
            c = client(await openai_url(sc))
            with pytest.raises(openai.BadRequestError, match="--chat-template"):
                await c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
            with pytest.raises(openai.RateLimitError) as limited:
                await c.completions.create(model=MODEL, prompt="x")
            assert limited.value.response.headers["retry-after"] == "1"
            await c.close()


async def test_a_lora_adapter_as_the_model(aio_loop: Any, tmp_path: Path) -> None:
    root = tmp_path / "loras"
    (root / "sql").mkdir(parents=True)
    adapter = {"loraId": "3", "loraName": "sql", "sourcePath": str(root / "sql")}
    with trio.fail_after(60):
        async with front(tmp_path) as (engine, sc, url), open_sidecar(sc.ws) as ws:
            await ws.call("loadLora", {"adapter": adapter})
            c = client(url)
            listed = {m.id: m.model_extra for m in (await c.models.list()).data}
            assert listed["sql"] is not None and listed["sql"]["parent"] == MODEL
            r = await c.completions.create(
                model="sql", prompt="x", max_tokens=2, extra_headers={"X-Request-Id": "oai-lora"}
            )
            assert r.model == "sql"
            seen = (await engine_counters(engine.address))["recent_requests"]["oai-lora"]
            assert (seen["model"], seen["lora_name"]) == (MODEL, "sql")
            metrics = (await httpx.AsyncClient().get(url.removesuffix("/v1") + "/metrics")).text
            assert re.search(r'vllm:lora_requests_info\{[^}]*running_lora_adapters="sql"', metrics)
            await c.close()


async def test_a_client_that_leaves_mid_stream_gets_its_stream_aborted(aio_loop: Any, tmp_path: Path) -> None:
    rid = "oai-leaves-1"
    with trio.fail_after(60):
        async with front(tmp_path, "--token-delay-ms", "5") as (engine, _, url):
            c = client(url)
            stream = await c.completions.create(
                model=MODEL,
                prompt="x",
                max_tokens=4000,
                stream=True,
                extra_body={"ignore_eos": True},
                extra_headers={"X-Request-Id": rid},
            )
            got = 0
            async for _ in stream:
                got += 1
                if got == 3:
                    break
            await stream.close()
            counters = await eventually(lambda: counters_once_aborted(engine.address, [rid]), 10)
            assert counters["aborts_received_by_id"][rid] == 1
            await wait_engine_idle(engine.address)
            await c.close()


async def test_drain_finishes_admitted_requests_and_refuses_new_ones(aio_loop: Any, tmp_path: Path) -> None:
    with trio.fail_after(60):
        async with front(tmp_path, "--token-delay-ms", "20", sidecar_args=("--drain-timeout", "20")) as (
            _,
            sc,
            url,
        ):
            c = client(url)
            stream = await c.completions.create(
                model=MODEL, prompt="x", max_tokens=60, stream=True, extra_body={"ignore_eos": True}
            )
            texts = []
            async for chunk in stream:
                texts.append(chunk)
                if len(texts) == 1:
                    sc.proc.signal(signal.SIGTERM)
                    await sc.proc.wait_for_line(re.compile("draining: 1 stream"))
                    with pytest.raises(openai.APIStatusError) as refused:
                        await c.completions.create(model=MODEL, prompt="x", max_tokens=1)
                    assert refused.value.status_code == 503
                    assert refused.value.response.headers["retry-after"] == "1"
                    assert refused.value.code == "draining"
            assert texts[-1].choices[0].finish_reason == "length"
            assert sum(1 for t in texts if t.choices and t.choices[0].text) == 60
            assert await sc.proc.wait(30) == 0
            await c.close()


async def test_the_gie_gauges_follow_the_engine_on_the_openai_listener(aio_loop: Any, tmp_path: Path) -> None:
    with trio.fail_after(60):
        async with front(tmp_path, "--token-delay-ms", "10", sidecar_args=("--load-interval", "0.1")) as (
            engine,
            _,
            url,
        ):
            c = client(url)
            metrics_url = url.removesuffix("/v1") + "/metrics"

            async def running() -> float | None:
                async with httpx.AsyncClient() as http:
                    text = (await http.get(metrics_url)).text
                m = re.search(r"^vllm:num_requests_running\{[^}]*\} (\S+)$", text, re.M)
                return float(m.group(1)) if m and float(m.group(1)) >= 3 else None

            async with trio.open_nursery() as nursery:
                for _ in range(3):
                    nursery.start_soon(
                        lambda: c.completions.create(
                            model=MODEL, prompt="x", max_tokens=300, extra_body={"ignore_eos": True}
                        )
                    )
                assert await eventually(running, 10) == 3.0
                nursery.cancel_scope.cancel()
            await wait_engine_idle(engine.address)
            await c.close()


def _throwaway_ca(tmp_path: Path) -> tuple[trustme.CA, Path, Path]:
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1")
    cert, key = tmp_path / "server.pem", tmp_path / "server.key"
    for i, blob in enumerate(server.cert_chain_pems):
        blob.write_to_path(str(cert), append=i > 0)
    server.private_key_pem.write_to_path(str(key))
    return ca, cert, key


async def test_tls_and_a_bearer_token(aio_loop: Any, tmp_path: Path) -> None:
    ca, cert, key = _throwaway_ca(tmp_path)
    token = tmp_path / "token"
    token.write_text("t0ken\n")
    context = ssl.create_default_context()
    ca.configure_trust(context)
    args = ("--tls-cert", str(cert), "--tls-key", str(key), "--auth-token-file", str(token))
    template = tmp_path / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    with trio.fail_after(60):
        async with (
            mock_engine(tmp_path) as engine,
            spawn([*loopback_run_args(engine.address), "--openai-listen", "127.0.0.1:0", *args]) as proc,
        ):
            url = (await proc.wait_for_line(OPENAI_READY)).group(1)
            assert url.startswith("https://")
            async with httpx.AsyncClient(verify=context) as http:
                good = client(url, api_key="t0ken", http_client=http)
                r = await good.completions.create(model=MODEL, prompt="x", max_tokens=2)
                assert r.choices[0].finish_reason in ("length", "stop")
                with pytest.raises(openai.AuthenticationError):
                    await client(url, api_key="wrong", http_client=http).models.list()
                assert (await http.get(url.removesuffix("/v1") + "/metrics")).status_code == 401


async def test_a_client_that_stops_reading_is_let_go_after_the_stall_timeout(
    aio_loop: Any, tmp_path: Path
) -> None:
    """A raw socket that sends a streamed request and never reads: once the sidecar's writes
    wait ``--stall-timeout``, the stream is cancelled and aborted in the engine."""
    rid = "oai-stalls-1"
    with trio.fail_after(60):
        engine_args = ("--fast", "--max-output-tokens", "1000000", "--max-context-length", "1000010")
        async with front(tmp_path, *engine_args, sidecar_args=("--stall-timeout", "1")) as (engine, sc, url):
            host, port = url.removeprefix("http://").removesuffix("/v1").rsplit(":", 1)
            fields = {"model": MODEL, "prompt": "x", "max_tokens": 500000, "stream": True, "ignore_eos": True}
            body = json.dumps(fields).encode()
            head = (
                f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
                f"x-request-id: {rid}\r\ncontent-length: {len(body)}\r\n\r\n"
            ).encode()
            stream = await trio.open_tcp_stream(host, int(port))
            await stream.send_all(head + body)
            await sc.proc.wait_for_line(re.compile("took nothing for 1s: connection closed"))
            counters = await eventually(lambda: counters_once_aborted(engine.address, [rid]), 10)
            assert counters["aborts_received_by_id"][rid] == 1
            await stream.aclose()
            await wait_engine_idle(engine.address)
