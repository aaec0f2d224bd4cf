"""``openengine-sidecar mock-engine``: run one simulated OpenEngine engine.

Every flag also reads ``OPENENGINE_SIDECAR_MOCK_<FLAG>`` (a ``MOCK_`` infix, so a
sidecar's own ``OPENENGINE_SIDECAR_LISTEN`` never configures an engine started from
the same environment). Logs one line when serving; exits 0 on SIGTERM/SIGINT, 1 with one
line when it cannot serve (a port in use, a Unix socket path another live process serves).
``--ready-file PATH`` writes a JSON description once serving (``-`` = one line on
stdout): ``{"address", "flavor", "role", "instance_id", "kv_events", "kv_endpoints",
"transfer_endpoint", "pid"}``.

By default the engine keeps the OpenEngine contract (``conformance`` passes). Deliberately
non-conformant behaviour is opt-in: ``--orphans hold`` (a request whose stream closed keeps
running until Abort — the test bed's leak detector) and the ``--fault`` switches.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from typing import Any

import click

from sidecar.cli_common import CommandError
from sidecar.cli_options import COUNT, HostName, ListenAddressType, NewFile, command_option, env_name
from sidecar.mock.app import BindError, ServingInfo, serve_engine
from sidecar.mock.config import FLAVORS, ROLES, SCHEMA_NAMES, EngineConfig
from sidecar.mock.faults import FaultSpecError, parse_faults
from sidecar.mock.schemas import RELEASE_FORMS

ENV_PREFIX = env_name("--", "mock-engine")[:-1]  # OPENENGINE_SIDECAR_MOCK_
_opt = command_option("mock-engine")


def write_ready(path: str, info: ServingInfo) -> None:
    """Write ``info`` (plus this pid) as one JSON line to ``path`` atomically; ``-`` = stdout."""
    data = json.dumps({**info.to_json(), "pid": os.getpid()})
    if path == "-":
        sys.stdout.write(data + "\n")
        sys.stdout.flush()
        return
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(data + "\n")
    os.replace(tmp, path)


@click.command("mock-engine")
@_opt("--flavor", type=click.Choice(FLAVORS), default="vllm", show_default=True, help="Engine to simulate.")
@_opt("--role", type=click.Choice(ROLES), default="aggregated", show_default=True, help="Serving role.")
@_opt(
    "--schema",
    type=click.Choice(SCHEMA_NAMES),
    default="a66ff6f",
    show_default=True,
    help="OpenEngine schema the engine is built on: what it advertises, sends and understands.",
)
@_opt(
    "--release-form",
    type=click.Choice(RELEASE_FORMS),
    default="source",
    show_default=True,
    help="schema_release as a source commit, a (synthetic) BSR commit or a buf.build/... reference.",
)
@_opt(
    "--listen",
    type=ListenAddressType(unix_ok=True),
    default="127.0.0.1:50051",
    show_default=True,
    help="HOST:PORT (port 0 = any) or unix:///PATH.",
)
@_opt("--model", default="", help="Served model name (default Qwen/Qwen3-0.6B).")
@_opt("--alias", "aliases", multiple=True, help="Additional accepted model name (repeatable).")
@_opt(
    "--tokenizer-source",
    default="",
    help="TokenizerInfo.source to report, e.g. a local tokenizer directory "
    "(default openengine-sidecar/mock-tokenizer-v1).",
)
@_opt(
    "--text-only",
    is_flag=True,
    help="Serve a text-only model: no multimodal capabilities, every media item refused.",
)
@_opt("--dp-size", type=click.IntRange(1, 64), default=1, show_default=True, help="Data-parallel ranks.")
@_opt(
    "--tp-size",
    type=click.IntRange(1, 64),
    default=1,
    show_default=True,
    help="Tensor-parallel size reported.",
)
@_opt("--kv-block-size", type=COUNT, default=16, show_default=True, help="Tokens per KV block.")
@_opt("--total-kv-blocks", type=COUNT, default=4096, show_default=True, help="Per DP rank.")
@_opt("--max-running", type=COUNT, default=64, show_default=True, help="Per DP rank.")
@_opt("--max-queue", type=click.IntRange(0), default=256, show_default=True, help="Per DP rank.")
@_opt("--max-context-length", type=click.IntRange(2), default=8192, show_default=True, help="Tokens.")
@_opt("--max-output-tokens", type=COUNT, default=4096, show_default=True, help="Tokens per request.")
@_opt("--token-delay-ms", type=click.FloatRange(0), default=0.0, show_default=True, help="Per decode step.")
@_opt(
    "--first-token-delay-ms", type=click.FloatRange(0), default=0.0, show_default=True, help="Prefill time."
)
@_opt(
    "--kv-events",
    type=click.Choice(["auto", "zmq", "grpc", "none"]),
    default="auto",
    show_default=True,
    help="How KV cache events are published (auto: the flavour's way).",
)
@_opt(
    "--kv-host",
    type=HostName(),
    default="127.0.0.1",
    show_default=True,
    help="Bind host of the ZMQ KV publishers.",
)
@_opt("--kv-port", type=click.IntRange(0, 65535), default=0, show_default=True, help="Base port; 0 = any.")
@_opt(
    "--kv-event-format",
    type=click.Choice(["map", "array"]),
    default="map",
    show_default=True,
    help="msgpack layout of the ZMQ KV events.",
)
@_opt(
    "--kv-log",
    type=NewFile(),
    default=None,
    help="Append every KV event batch (ground truth) to this JSON-lines file.",
)
@_opt(
    "--transfer-host",
    type=HostName(),
    default="127.0.0.1",
    show_default=True,
    help="Prefill's KV transfer listener.",
)
@_opt(
    "--transfer-port", type=click.IntRange(0, 65535), default=0, show_default=True, help="Its port; 0 = any."
)
@_opt(
    "--kv-session-timeout",
    type=click.FloatRange(0),
    default=60.0,
    show_default=True,
    help="Seconds a prefill keeps a KV session nobody pulls.",
)
@_opt(
    "--bootstrap-timeout",
    type=click.FloatRange(0),
    default=30.0,
    show_default=True,
    help="Seconds a bootstrap room waits for its other side.",
)
@_opt("--lora/--no-lora", "enable_lora", default=True, show_default=True, help="Support LoRA adapters.")
@_opt("--max-loras", type=click.IntRange(0), default=4, show_default=True, help="Adapters loaded at once.")
@_opt(
    "--lora-path-check/--no-lora-path-check",
    default=True,
    show_default=True,
    help="Refuse adapter paths that do not exist.",
)
@_opt(
    "--orphans",
    type=click.Choice(["release", "hold"]),
    default="release",
    show_default=True,
    help="What a request whose client left without Abort does: release it (conformant), or hold "
    "it until Abort or --orphan-timeout (non-conformant; tests use it to catch a missing Abort).",
)
@_opt(
    "--orphan-timeout",
    type=click.FloatRange(0),
    default=30.0,
    show_default=True,
    help="Seconds a held orphan lives.",
)
@_opt("--fast", is_flag=True, help="Benchmark mode: pre-encoded responses, no delays.")
@_opt("--seed", type=int, default=0, show_default=True, help="Engine-wide generation seed.")
@_opt("--instance-id", default="", help="Instance id to report (default: from flavour, role, address).")
@_opt("--fault", "faults", multiple=True, help="NAME[=VALUE] (repeatable); see sidecar.mock.faults.")
@_opt(
    "--ready-file",
    type=NewFile(allow_dash=True),
    default=None,
    help="Write serving info (JSON) here once serving; '-' = stdout.",
)
def mock_engine(**kw: Any) -> None:
    """Run a simulated TensorRT-LLM / vLLM / SGLang engine speaking OpenEngine v1."""
    try:
        faults = parse_faults(kw.pop("faults"), role=kw["role"])
    except FaultSpecError as err:
        raise click.BadParameter(str(err), param_hint="--fault") from None
    ready_file = kw.pop("ready_file")
    try:
        config = EngineConfig(
            flavor=kw["flavor"],
            role=kw["role"],
            schema=kw["schema"],
            release_form=kw["release_form"],
            listen=kw["listen"],
            model=kw["model"],
            aliases=tuple(kw["aliases"]),
            tokenizer_source=kw["tokenizer_source"],
            text_only=kw["text_only"],
            dp_size=kw["dp_size"],
            tp_size=kw["tp_size"],
            kv_block_size=kw["kv_block_size"],
            total_kv_blocks=kw["total_kv_blocks"],
            max_running=kw["max_running"],
            max_queue=kw["max_queue"],
            max_context_length=kw["max_context_length"],
            max_output_tokens=kw["max_output_tokens"],
            token_delay_ms=kw["token_delay_ms"],
            first_token_delay_ms=kw["first_token_delay_ms"],
            kv_events=kw["kv_events"],
            kv_host=kw["kv_host"],
            kv_port=kw["kv_port"],
            kv_event_format=kw["kv_event_format"],
            kv_log=kw["kv_log"] or "",
            transfer_host=kw["transfer_host"],
            transfer_port=kw["transfer_port"],
            kv_session_timeout_s=kw["kv_session_timeout"],
            bootstrap_timeout_s=kw["bootstrap_timeout"],
            enable_lora=kw["enable_lora"],
            max_loras=kw["max_loras"],
            check_lora_path=kw["lora_path_check"],
            orphans=kw["orphans"],
            orphan_timeout_s=kw["orphan_timeout"],
            fast=kw["fast"],
            seed=kw["seed"],
            instance_id=kw["instance_id"],
            faults=faults,
        )
    except ValueError as err:
        raise click.UsageError(str(err)) from None

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await serve_engine(
            config,
            stop=stop,
            on_ready=(lambda info: write_ready(ready_file, info)) if ready_file else None,
            hang_signals=True,
        )

    try:
        asyncio.run(main())
    except BindError as err:
        raise CommandError(str(err)) from None
    except OSError as err:
        raise CommandError(f"cannot serve on {config.listen}: {err.strerror or err}") from None
