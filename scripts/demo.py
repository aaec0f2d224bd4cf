"""The embedded-default demo (run through scripts/demo): real processes, real sockets.

1. ``openengine-sidecar mock-engine --flavor vllm`` on a Unix socket (a simulated engine);
2. ``openengine-sidecar run`` in front of it, on ephemeral ports;
3. the worker card (``describe`` over the WebSocket protocol);
4. a streamed completion, printed as it arrives;
5. a second completion, cancelled after a few tokens: the engine sees its stream closed and
   exactly one Abort (read back from the engine's own counters);
6. SIGTERM to the sidecar: it drains and exits 0; then the engine is stopped.

The children's logs are shown between the steps, never inside the streamed text. Ctrl-C
stops both children and exits 130 with one line.
"""

from __future__ import annotations

import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

import trio
import trio_asyncio

from sidecar.childproc import ENGINE_READY, SIDECAR_READY, ChildProcess, loopback_run_args, spawn_child
from sidecar.client.sidecar_client import open_sidecar
from sidecar.openengine.client import open_engine_client

MODEL = "Qwen/Qwen3-0.6B"
EXIT_INTERRUPTED = 130


def say(text: str) -> None:
    print(f"\n\033[1m== {text}\033[0m", flush=True)


class Log:
    """Shows a child's log lines not shown yet, indented (between the demo's steps)."""

    def __init__(self, name: str, child: ChildProcess) -> None:
        self.name, self.child, self.shown = name, child, 0

    def show(self) -> None:
        for line in self.child.lines[self.shown :]:
            print(f"   [{self.name}] {line.split(' ', 2)[-1]}", flush=True)
        self.shown = len(self.child.lines)


def python_sidecar(*args: str) -> list[str]:
    return [sys.executable, "-m", "sidecar", *args]


def request(max_tokens: int, rid: str) -> dict[str, Any]:
    return {
        "requestId": rid,
        "model": MODEL,
        "prompt": "The sidecar relays every token of",
        "stopping": {"maxTokens": max_tokens, "ignoreEos": True},
    }


async def demo(tmp: Path) -> int:
    sock = tmp / "engine.sock"
    engine_argv = python_sidecar(
        "mock-engine", "--flavor", "vllm", "--listen", f"unix://{sock}", "--token-delay-ms", "40"
    )
    sidecar_argv = python_sidecar(*loopback_run_args(f"unix://{sock}"), "--drain-timeout", "5")
    say("starting a simulated vLLM engine (openengine-sidecar mock-engine --flavor vllm)")
    async with spawn_child(engine_argv, name="engine") as engine:
        engine_log = Log("engine ", engine)
        await engine.wait_for_line(ENGINE_READY, timeout=60)
        engine_log.show()
        say("starting the sidecar in front of it (openengine-sidecar run)")
        async with spawn_child(sidecar_argv, name="sidecar") as sidecar:
            sidecar_log = Log("sidecar", sidecar)
            m = await sidecar.wait_for_line(SIDECAR_READY, timeout=60)
            sidecar_log.show()
            ws_url, http_url = m.group(1), m.group(2)
            await show_streams(ws_url, http_url, sock)
            engine_log.show()
            say("SIGTERM to the sidecar: drain, then exit")
            sidecar.signal(signal.SIGTERM)
            code = await sidecar.wait(timeout=30)
            sidecar_log.show()
            print(f"   sidecar exited with status {code}")
    return code


async def show_streams(ws_url: str, http_url: str, sock: Path) -> None:
    async with open_sidecar(ws_url) as client:
        say(f"worker card (call 'describe' on {ws_url}; also GET {http_url}/v1/worker)")
        card = await client.call("describe")
        print(f"   engine      {card['engine']['name']} {card['engine']['version']}, role {card['role']}")
        print(f"   schema      revision {card['schema']['revision']}, release {card['schema']['release']}")
        print(f"   models      {', '.join(card['servedModelNames'])}")
        print(f"   DP ranks    {card['dpRanks']}")
        print(f"   KV events   {', '.join(card['kvPublishEndpoints']) or 'none'}")

        say("a streamed completion (20 tokens)")
        print("   ", end="")
        async with client.generate(request(20, "demo-complete")) as stream:
            async for event in stream:
                if event.response.token is not None:
                    print(event.response.token.text, end="", flush=True)
        print(f"\n   end: {stream.end.outcome if stream.end else '?'}")

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
        assert end is not None
        print(f"\n   end: {end.outcome} ({end.error.code if end.error else ''})")

    async with open_engine_client(f"unix://{sock}") as engine_client:
        load = await engine_client.get_load()
    counters = load.attributes.to_dict() if load.attributes is not None else {}
    aborts = counters.get("aborts_received_by_id", {})
    print(
        f"   the engine saw: Abort(demo-cancel) x{int(aborts.get('demo-cancel', 0))}, requests completed "
        f"{int(counters.get('requests_completed', 0))}, leaked {int(counters.get('requests_leaked', 0))}"
    )


async def main() -> int:
    """The demo, stopped cleanly (children ended) by Ctrl-C or SIGTERM."""
    code = EXIT_INTERRUPTED
    with (
        trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals,
        tempfile.TemporaryDirectory(prefix="openengine-demo-") as tmp,
    ):
        async with trio_asyncio.open_loop(), trio.open_nursery() as nursery:

            async def stop_on_signal() -> None:
                async for _ in signals:
                    nursery.cancel_scope.cancel()
                    return

            async def run_demo() -> None:
                nonlocal code
                code = await demo(Path(tmp))
                nursery.cancel_scope.cancel()

            nursery.start_soon(stop_on_signal)
            nursery.start_soon(run_demo)
    if code == EXIT_INTERRUPTED:
        print("\ndemo: interrupted; the engine and the sidecar are stopped", file=sys.stderr, flush=True)
    elif code == 0:
        say("done")
    return code


if __name__ == "__main__":
    sys.exit(trio.run(main))
