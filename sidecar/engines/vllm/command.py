"""``openengine-sidecar vllm-engine``: stock vLLM (CPU build) behind an OpenEngine v1 server.

Needs the ``vllm`` extra (``scripts/install-vllm``); without it the command exits 1 with that
reason. Every flag also reads ``OPENENGINE_SIDECAR_VLLM_<FLAG>``. Logs one line when serving
(``... serving OpenEngine on ADDR; kv events zmq tcp://HOST:PORT``); exits 0 on SIGTERM/SIGINT.
``--ready-file PATH`` writes the same JSON as ``mock-engine`` once serving. docs/ENGINES.md.
"""

from __future__ import annotations

from typing import Any

import click

from sidecar.cli_options import command_option, env_name
from sidecar.engines.common.command import adapter_options, prepare_model, run_until_signal
from sidecar.engines.vllm.config import VllmSettings

ENV_PREFIX = env_name("--", "vllm-engine")[:-1]  # OPENENGINE_SIDECAR_VLLM_
EXTRA_MISSING = "the 'vllm' extra is not installed (run scripts/install-vllm)"
_opt = command_option("vllm-engine")


def _block_size(_ctx: click.Context, _param: click.Parameter, value: int | None) -> int | None:
    if value is not None and value % 32:
        raise click.BadParameter(f"{value} is not a multiple of 32 (vLLM's CPU attention needs that)")
    return value


@click.command("vllm-engine")
@adapter_options("vllm-engine", "vLLM")
@_opt("--dtype", default="auto", show_default=True, help="vLLM --dtype (the tiny model is float32).")
@_opt("--block-size", type=click.IntRange(32), callback=_block_size, help="KV block size (multiple of 32).")
@_opt("--max-model-len", type=click.IntRange(2), help="Context length (default: the model's).")
@_opt("--max-num-seqs", type=click.IntRange(1), help="Running requests per step (vLLM's default).")
@_opt("--max-num-batched-tokens", type=click.IntRange(1), help="Tokens per step (vLLM's default).")
@_opt("--kv-cache-gib", type=click.IntRange(1), default=1, show_default=True, help="VLLM_CPU_KVCACHE_SPACE.")
@_opt("--kv-cache-blocks", type=click.IntRange(1), help="Exact number of KV blocks (overrides the size).")
@_opt(
    "--prefix-caching/--no-prefix-caching",
    default=True,
    show_default=True,
    help="vLLM automatic prefix caching.",
)
@_opt("--enforce-eager/--compile", default=True, show_default=True, help="Eager mode starts in seconds.")
@_opt(
    "--scheduling-policy",
    type=click.Choice(["fcfs", "priority"]),
    default="fcfs",
    show_default=True,
    help="vLLM scheduler policy (priority: requests' priority is honoured).",
)
def vllm_engine(**kw: Any) -> None:
    """Serve stock vLLM (CPU build) as an OpenEngine v1 engine."""
    model, ready_file = prepare_model(kw, "vllm", EXTRA_MISSING)
    settings = VllmSettings(model=str(model), served_model_names=tuple(kw.pop("served_model_names")), **kw)

    from sidecar.engines.vllm.app import serve_vllm

    run_until_signal(lambda **run: serve_vllm(settings, **run), settings.listen, ready_file)


if __name__ == "__main__":  # engine processes are spawned: they re-import the main module
    vllm_engine()
