"""The embedded-default demo (run through scripts/demo): real processes, real sockets.

1. ``openengine-sidecar mock-engine --flavor vllm`` on a Unix socket (a simulated engine);
2. ``openengine-sidecar run`` in front of it, on ephemeral ports;
3. the worker card (``describe`` over the WebSocket protocol);
4. a streamed completion, printed as it arrives;
5. a second completion, cancelled after a few tokens: the engine sees its stream closed and
   exactly one Abort (read back from the engine's own counters);
6. SIGTERM to the sidecar: it drains and exits 0; then the engine is stopped.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import trio
import trio_asyncio

from sidecar.client.sidecar_client import open_sidecar
from sidecar.openengine.client import open_engine_client

MODEL = "Qwen/Qwen3-0.6B"


def say(text: str) -> None:
    print(f"\n\033[1m== {text}\033[0m", flush=True)


class Child:
    """A ``python -m sidecar`` child process whose log is shown indented."""

    def __init__(self, name: str, args: list[str]) -> None:
        self.name = name
        self.args = args
        self.lines: list[str] = []
        self.process: trio.Process | None = None
        self._new_line = trio.Event()

    async def start(self, nursery: trio.Nursery, ready: str) -> re.Match[str]:
        self.process = await trio.lowlevel.open_process(
            [sys.executable, "-m", "sidecar", *self.args],
            stdin=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        nursery.start_soon(self._pump)
        pattern = re.compile(ready)
        with trio.fail_after(60):
            seen = 0
            while True:
                for line in self.lines[seen:]:
                    if m := pattern.search(line):
                        return m
                seen = len(self.lines)
                if self.process.returncode is not None:
                    raise SystemExit(f"{self.name} exited with {self.process.returncode}")
                await self._new_line.wait()

    async def _pump(self) -> None:
        assert self.process is not None and self.process.stderr is not None
        buf = b""
        async for chunk in self.process.stderr:
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for raw in lines:
                line = raw.decode(errors="replace")
                self.lines.append(line)
                print(f"   [{self.name}] {line.split(' ', 2)[-1]}", flush=True)
            self._new_line.set()
            self._new_line = trio.Event()

    async def stop(self, timeout: float = 30) -> int:
        assert self.process is not None
        if self.process.returncode is None:
            self.process.send_signal(signal.SIGTERM)
        with trio.move_on_after(timeout):
            return await self.process.wait()
        self.process.kill()
        return await self.process.wait()


def request(max_tokens: int, rid: str) -> dict[str, Any]:
    return {
        "requestId": rid,
        "model": MODEL,
        "prompt": "The sidecar relays every token of",
        "stopping": {"maxTokens": max_tokens, "ignoreEos": True},
    }


async def main() -> None:
    with tempfile.TemporaryDirectory(prefix="openengine-demo-") as tmp:
        sock = Path(tmp) / "engine.sock"
        engine = Child(
            "engine ",
            ["mock-engine", "--flavor", "vllm", "--listen", f"unix://{sock}", "--token-delay-ms", "40"],
        )
        sidecar = Child("sidecar", [
            "run", "--engine", f"unix://{sock}", "--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0",
            "--kv-publish", "tcp://127.0.0.1:0", "--kv-replay", "tcp://127.0.0.1:0", "--drain-timeout", "5",
        ])  # fmt: skip
        async with trio_asyncio.open_loop(), trio.open_nursery() as nursery:
            say("starting a simulated vLLM engine (openengine-sidecar mock-engine --flavor vllm)")
            await engine.start(nursery, r"serving OpenEngine on")
            say("starting the sidecar in front of it (openengine-sidecar run)")
            m = await sidecar.start(nursery, r"serving (ws://\S+) and (http://\S+)")
            ws_url, http_url = m.group(1), m.group(2)

            async with open_sidecar(ws_url) as client:
                say(f"worker card (call 'describe' on {ws_url}; also GET {http_url}/v1/worker)")
                card = await client.call("describe")
                print(
                    f"   engine      {card['engine']['name']} {card['engine']['version']}, role {card['role']}"
                )
                print(
                    f"   schema      revision {card['schema']['revision']}, release {card['schema']['release']}"
                )
                print(f"   models      {', '.join(card['servedModelNames'])}")
                print(f"   DP ranks    {card['dpRanks']}")
                print(f"   KV events   {', '.join(card['kvPublishEndpoints']) or 'none'}")

                say("a streamed completion (20 tokens)")
                print("   ", end="")
                async with client.generate(request(20, "demo-complete")) as stream:
                    async for event in stream:
                        if event.response.token is not None:
                            print(event.response.token.text, end="", flush=True)
                print(f"\n   end: {stream.end.outcome}")

                say("a completion cancelled after 5 tokens")
                print("   ", end="")
                async with client.generate(request(200, "demo-cancel")) as stream:
                    n = 0
                    async for event in stream:
                        if event.response.token is not None:
                            print(event.response.token.text, end="", flush=True)
                            n += 1
                            if n == 5:
                                await stream.cancel()
                end = stream.end
                print(f"\n   end: {end.outcome} ({end.error.code if end.error else ''})")

            async with open_engine_client(f"unix://{sock}") as engine_client:
                counters = (await engine_client.get_load()).attributes.to_dict()
            aborts = counters.get("aborts_received_by_id", {})
            print(
                f"   the engine saw: Abort(demo-cancel) x{int(aborts.get('demo-cancel', 0))}, "
                f"requests completed {int(counters['requests_completed'])}, leaked {int(counters['requests_leaked'])}"
            )

            say("SIGTERM to the sidecar: drain, then exit")
            code = await sidecar.stop()
            print(f"   sidecar exited with status {code}")
            await engine.stop()
            nursery.cancel_scope.cancel()
        if code != 0:
            raise SystemExit(code)
        say("done")


if __name__ == "__main__":
    trio.run(main)
