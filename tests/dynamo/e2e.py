"""A real Dynamo deployment on this machine for end-to-end tests: frontend, sidecars, mock engines.

Everything runs as subprocesses on loopback: Dynamo's frontend (``python -m dynamo.frontend``)
on the deployment's discovery backend and planes (``tests.dynamo.planes``: a real etcd, and
nats-server for the NATS planes; or file discovery under the test's tmp dir when a test passes
its ``tmp_path``), every host pinned to 127.0.0.1; ``openengine-sidecar run --dynamo`` in front of
``mock-engine`` whose tokenizer source is a tokenizer directory of the mock vocabulary built at
test time (``sidecar.dynamo.tokenizer_dir``). Readiness is polled (another process's state),
always bounded.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from sidecar.childproc import loopback_run_args
from sidecar.client.sidecar_client import open_sidecar
from sidecar.dynamo.tokenizer_dir import write_mock_tokenizer_dir
from tests.dynamo.planes import Deployment, file_deployment, free_port
from tests.e2e.harness import SIDECAR_READY, Proc, eventually, spawn, spawn_argv
from tests.prereq import require_module

MODEL = "Qwen/Qwen3-0.6B"

#: The frontend's log line once its prefill router can forward: until then a P/D model is
#: already listed but every request is answered 503 (Dynamo activates the router shortly
#: after it discovers the prefill worker; CI hit that window).
PREFILL_ACTIVATED = re.compile(r"Prefill router target activated")
#: The frontend logs at the deployment's level, plus the activation line above.
FRONTEND_LOG_EXTRA = "dynamo_llm::kv_router::prefill_router::activation=info"


def require_dynamo() -> None:
    """Skip unless the 'dynamo' extra is installed (scripts/install-dynamo); fail under CI."""
    require_module("dynamo.llm", "scripts/install-dynamo")
    require_module("tokenizers", "scripts/install-dynamo")


def as_deployment(where: Path | Deployment) -> Deployment:
    """A test's deployment; a bare ``tmp_path`` means file discovery there (tcp, zmq)."""
    return where if isinstance(where, Deployment) else file_deployment(where)


def dynamo_env(where: Path | Deployment) -> dict[str, str]:
    """DYN_* settings shared by the frontend and the workers of one test deployment."""
    return as_deployment(where).env()


def tokenizer_dir(tmp_path: Path) -> Path:
    return write_mock_tokenizer_dir(tmp_path / "mock-tokenizer")


@dataclass
class Frontend:
    proc: Proc
    url: str
    http: httpx.AsyncClient

    async def models(self) -> list[str]:
        resp = await self.http.get("/v1/models")
        return [m["id"] for m in resp.json()["data"]] if resp.status_code == 200 else []

    async def wait_models(self, *names: str, timeout: float = 30) -> None:
        async def listed() -> bool:
            return set(names) <= set(await self.models())

        await eventually(listed, timeout, interval=0.1)

    async def wait_prefill_activated(self, timeout: float = 30) -> None:
        """Until the frontend's prefill router forwards (P/D deployments; see PREFILL_ACTIVATED)."""
        await self.proc.wait_for_line(PREFILL_ACTIVATED, timeout)

    async def complete(self, prompt: str, **body: Any) -> dict[str, Any]:
        resp = await self.http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, **body})
        assert resp.status_code == 200, resp.text
        return resp.json()  # type: ignore[no-any-return]

    async def stream(self, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
        """The SSE chunks of a streaming call (``data: [DONE]`` excluded)."""
        out = []
        async with self.http.stream("POST", path, json={**body, "stream": True}) as resp:
            assert resp.status_code == 200, await resp.aread()
            async for line in resp.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    out.append(json.loads(line[6:]))
        return out


@asynccontextmanager
async def frontend(where: Path | Deployment, *args: str, port: int = 0) -> AsyncIterator[Frontend]:
    """``python -m dynamo.frontend`` on a free loopback port (or ``port``), on the deployment's
    discovery backend and planes (``args``: extra frontend flags)."""
    dep = as_deployment(where)
    port = port or free_port()
    argv = [
        sys.executable,
        "-m",
        "dynamo.frontend",
        "--http-host",
        "127.0.0.1",
        "--http-port",
        str(port),
        *dep.frontend_args(),
        *args,
    ]
    env = dep.env()
    env["DYN_LOG"] = f"{env['DYN_LOG']},{FRONTEND_LOG_EXTRA}"
    async with spawn_argv(argv, env) as proc:
        url = f"http://127.0.0.1:{port}"
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            fe = Frontend(proc, url, http)

            async def up() -> bool:
                try:
                    return (await http.get("/v1/models")).status_code == 200
                except httpx.TransportError:
                    return False

            await eventually(up, 30, interval=0.1)
            yield fe


@dataclass
class DynamoSidecar:
    proc: Proc
    ws: str
    http: str
    bound: dict[str, str]


@asynccontextmanager
async def dynamo_sidecar(
    where: Path | Deployment, engine_address: str, *args: str, name: str = "sidecar"
) -> AsyncIterator[DynamoSidecar]:
    """``run --dynamo`` (on this test's deployment) in front of ``engine_address``."""
    dep = as_deployment(where)
    ready = dep.tmp_path / f"{name}.json"
    argv = [
        *loopback_run_args(engine_address),
        "--ready-file",
        str(ready),
        "--dynamo",
        *dep.sidecar_args(),
        *args,
    ]
    async with spawn(argv, env=dep.env()) as proc:
        m = await proc.wait_for_line(SIDECAR_READY, timeout=30)

        async def written() -> bool:
            if proc.process.returncode is not None:
                raise AssertionError("the sidecar exited:\n" + "\n".join(proc.lines[-20:]))
            return ready.exists() and bool(ready.read_text())

        await eventually(written, 30)
        yield DynamoSidecar(proc, m.group(1), m.group(2), json.loads(ready.read_text()))


async def ws_text(ws: str, token_ids: list[int], max_tokens: int) -> str:
    """What the engine generates for ``token_ids``, read through the WebSocket plane."""
    request = {
        "model": MODEL,
        "tokenIds": {"ids": token_ids},
        "stopping": {"maxTokens": max_tokens, "ignoreEos": True},
    }
    async with open_sidecar(ws) as client, client.generate(request) as stream:
        return "".join([e.response.text async for e in stream])


def encode(tok_dir: Path, text: str) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tok_dir / "tokenizer.json")).encode(text).ids  # type: ignore[no-any-return]
