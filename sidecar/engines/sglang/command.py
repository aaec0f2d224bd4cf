"""``openengine-sidecar sglang-engine``: stock SGLang (its generic CPU path) behind an OpenEngine v1 server.

Needs the ``sglang`` extra (``scripts/install-sglang``); without it the command exits 1 with that
reason. Every flag also reads ``OPENENGINE_SIDECAR_SGLANG_<FLAG>``. Logs one line when serving
(``... serving OpenEngine on ADDR; kv events zmq tcp://HOST:PORT``); exits 0 on SIGTERM/SIGINT.
``--ready-file PATH`` writes the same JSON as ``mock-engine`` once serving. docs/ENGINES.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from sidecar.cli_options import HostName, NewFile, command_option, env_name
from sidecar.engines.common.command import check_listen, check_model_dir, require_extra, run_until_signal
from sidecar.engines.sglang.config import SglangSettings

ENV_PREFIX = env_name("--", "sglang-engine")[:-1]  # OPENENGINE_SIDECAR_SGLANG_
EXTRA_MISSING = "the 'sglang' extra is not installed (run scripts/install-sglang)"
_opt = command_option("sglang-engine")


@click.command("sglang-engine")
@_opt(
    "--model", required=True, type=click.Path(file_okay=False, path_type=Path), help="Local model directory."
)
@_opt(
    "--build-tiny-model",
    is_flag=True,
    help="First build a tiny random-weight Llama in --model unless one is there (sidecar.engines.vllm.tiny_model).",
)
@_opt(
    "--listen",
    default="127.0.0.1:50051",
    show_default=True,
    callback=check_listen,
    help="HOST:PORT or unix:///PATH.",
)
@_opt("--served-model-name", "served_model_names", multiple=True, help="Served name; repeat for aliases.")
@_opt("--dtype", default="auto", show_default=True, help="SGLang --dtype (the tiny model is float32).")
@_opt("--page-size", type=click.IntRange(1), default=16, show_default=True, help="KV page (block) size.")
@_opt("--context-length", type=click.IntRange(2), help="Context length (default: the model's).")
@_opt(
    "--max-total-tokens",
    type=click.IntRange(16),
    default=8192,
    show_default=True,
    help="KV cache size in tokens (SGLang's --max-total-tokens).",
)
@_opt("--max-running-requests", type=click.IntRange(1), help="Running requests at once (SGLang's default).")
@_opt(
    "--radix-cache/--no-radix-cache", default=True, show_default=True, help="SGLang's prefix (radix) cache."
)
@_opt(
    "--max-logprobs", type=click.IntRange(0), default=20, show_default=True, help="Most logprobs per token."
)
@_opt("--seed", type=int, default=0, show_default=True, help="Engine-wide random seed.")
@_opt("--kv-events/--no-kv-events", default=True, show_default=True, help="SGLang's ZMQ KV event publisher.")
@_opt(
    "--kv-host",
    type=HostName(empty_ok=True),
    default="",
    help="Routable host advertised for the KV publisher (default: the listen host).",
)
@_opt("--kv-port", type=click.IntRange(0, 65535), default=0, show_default=True, help="0 = any free port.")
@_opt(
    "--kv-replay-port", type=click.IntRange(0, 65535), default=0, show_default=True, help="0 = any free port."
)
@_opt("--kv-topic", default="", help="ZMQ topic of the KV events.")
@_opt("--kv-buffer-steps", type=click.IntRange(1), default=10_000, show_default=True, help="Replay buffer.")
@_opt("--instance-id", default="", help="Instance id to report (default: random).")
@_opt(
    "--ready-file",
    type=NewFile(allow_dash=True),
    default=None,
    help="Write serving info (JSON) here once serving; '-' = stdout.",
)
def sglang_engine(**kw: Any) -> None:
    """Serve stock SGLang (CPU) as an OpenEngine v1 engine."""
    model: Path = kw.pop("model")
    build = kw.pop("build_tiny_model")
    if not build:
        check_model_dir(model)  # a usage error whether or not the extra is installed
    require_extra("sglang", EXTRA_MISSING)
    if build:
        from sidecar.engines.vllm.tiny_model import build_tiny_model

        try:
            build_tiny_model(model)
        except FileExistsError as err:
            raise click.BadParameter(str(err), param_hint="--model") from None
        check_model_dir(model)
    ready_file = kw.pop("ready_file")
    settings = SglangSettings(model=str(model), served_model_names=tuple(kw.pop("served_model_names")), **kw)

    from sidecar.engines.sglang.app import serve_sglang

    run_until_signal(lambda **run: serve_sglang(settings, **run), settings.listen, ready_file)


if __name__ == "__main__":  # engine processes are spawned: they re-import the main module
    sglang_engine()
