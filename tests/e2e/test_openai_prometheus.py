"""A real Prometheus (Debian's ``prometheus``) scrapes the OpenAI front's ``/metrics`` while
requests run: it reads GIE's model-server gauges with their types and the engine's load in them."""

from __future__ import annotations

import re
import socket
from pathlib import Path
from typing import Any

import httpx
import openai
import trio

from tests.e2e.harness import eventually, spawn_argv, wait_engine_idle
from tests.e2e.test_openai import MODEL, client, front
from tests.prereq import require_tool

GIE_GAUGES = (
    "vllm:num_requests_waiting",
    "vllm:num_requests_running",
    "vllm:kv_cache_usage_perc",
    "vllm:lora_requests_info",
    "vllm:cache_config_info",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def test_prometheus_reads_the_gie_gauges_while_requests_run(aio_loop: Any, tmp_path: Path) -> None:
    prometheus = require_tool("prometheus")
    with trio.fail_after(90):
        async with front(tmp_path, "--token-delay-ms", "20", sidecar_args=("--load-interval", "0.1")) as (
            engine,
            _,
            url,
        ):
            target = url.removeprefix("http://").removesuffix("/v1")
            config = tmp_path / "prometheus.yml"
            config.write_text(
                "global:\n  scrape_interval: 1s\n"
                "scrape_configs:\n  - job_name: sidecar\n"
                f"    static_configs:\n      - targets: ['{target}']\n"
            )
            web = f"127.0.0.1:{free_port()}"
            argv = [
                prometheus,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address={web}",
            ]
            async with spawn_argv(argv, label="prometheus") as prom, httpx.AsyncClient() as http:
                await prom.wait_for_line(re.compile("Server is ready to receive web requests"))
                api = f"http://{web}/api/v1"
                c: openai.AsyncOpenAI = client(url)

                async def running_seen() -> float | None:
                    r = (await http.get(f"{api}/query", params={"query": "vllm:num_requests_running"})).json()
                    values = [float(s["value"][1]) for s in r["data"]["result"]]
                    return values[0] if values and values[0] >= 4 else None

                async with trio.open_nursery() as nursery:
                    for _ in range(4):
                        nursery.start_soon(
                            lambda: c.completions.create(
                                model=MODEL, prompt="x", max_tokens=400, extra_body={"ignore_eos": True}
                            )
                        )
                    assert await eventually(running_seen, 30) == 4.0
                    nursery.cancel_scope.cancel()

                async def metadata() -> dict[str, Any] | None:
                    r = (
                        await http.get(f"{api}/targets/metadata", params={"match_target": '{job="sidecar"}'})
                    ).json()
                    types = {m["metric"]: m["type"] for m in r["data"]}
                    return types if all(g in types for g in GIE_GAUGES) else None

                types = await eventually(metadata, 15)
                assert {g: types[g] for g in GIE_GAUGES} == dict.fromkeys(GIE_GAUGES, "gauge")
                usage = (await http.get(f"{api}/query", params={"query": "vllm:kv_cache_usage_perc"})).json()
                assert 0.0 <= float(usage["data"]["result"][0]["value"][1]) <= 1.0
                await c.close()
            await wait_engine_idle(engine.address)
