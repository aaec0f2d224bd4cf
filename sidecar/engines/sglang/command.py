"""``openengine-sidecar sglang-engine``: stock SGLang (its generic CPU path) behind an OpenEngine v1 server.

Needs the ``sglang`` extra (``scripts/install-sglang``); without it the command exits 1 with that
reason. Every flag also reads ``OPENENGINE_SIDECAR_SGLANG_<FLAG>``. Logs one line when serving
(``... serving OpenEngine on ADDR; kv events zmq tcp://HOST:PORT``); exits 0 on SIGTERM/SIGINT.
``--ready-file PATH`` writes the same JSON as ``mock-engine`` once serving. docs/ENGINES.md.
"""

from __future__ import annotations

from typing import Any

import click

from sidecar.cli_options import command_option, env_name
from sidecar.engines.common.command import adapter_options, prepare_model, run_until_signal
from sidecar.engines.sglang.config import SglangSettings

ENV_PREFIX = env_name("--", "sglang-engine")[:-1]  # OPENENGINE_SIDECAR_SGLANG_
EXTRA_MISSING = "the 'sglang' extra is not installed (run scripts/install-sglang)"
_opt = command_option("sglang-engine")


@click.command("sglang-engine")
@adapter_options("sglang-engine", "SGLang")
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
def sglang_engine(**kw: Any) -> None:
    """Serve stock SGLang (CPU) as an OpenEngine v1 engine."""
    model, ready_file = prepare_model(kw, "sglang", EXTRA_MISSING)
    settings = SglangSettings(model=str(model), served_model_names=tuple(kw.pop("served_model_names")), **kw)

    from sidecar.engines.sglang.app import serve_sglang

    run_until_signal(lambda **run: serve_sglang(settings, **run), settings.listen, ready_file)


if __name__ == "__main__":  # engine processes are spawned: they re-import the main module
    sglang_engine()
