"""What every adapter's command shares: the ``--listen`` check, the extra check, serving until a signal.

An adapter's click command validates its flags at parse time (one line, exit 2), checks its
extra is installed (exit 1 with the installer to run), then hands an asyncio ``serve`` function
to :func:`run_until_signal`: SIGTERM/SIGINT set the ``stop`` event it receives (exit 0), and
``--ready-file`` gets the same JSON as ``mock-engine`` once serving.
"""

from __future__ import annotations

import asyncio
import importlib.util
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from sidecar.addresses import parse_listen
from sidecar.cli_common import CommandError
from sidecar.cli_options import HostName, NewFile, command_option
from sidecar.mock.app import ServingInfo

Serve = Callable[..., Awaitable[None]]
F = TypeVar("F", bound=Callable[..., Any])


def check_listen(_ctx: click.Context, _param: click.Parameter, value: str) -> str:
    """click callback: ``HOST:PORT`` or ``unix:///PATH``."""
    try:
        parse_listen(value)
    except ValueError as err:
        raise click.BadParameter(str(err)) from None
    return value


def require_extra(module: str, message: str) -> None:
    """Exit 1 with ``message`` unless ``module`` is installed (its extra)."""
    if importlib.util.find_spec(module) is None:
        raise CommandError(message)


def check_model_dir(model: Path) -> None:
    if not (model / "config.json").is_file():
        raise click.BadParameter(f"{model} has no config.json (a model directory)", param_hint="--model")


def run_until_signal(serve: Serve, listen: str, ready_file: Any) -> None:
    """``asyncio.run(serve(stop=..., on_ready=...))`` until SIGTERM/SIGINT; a bind failure exits 1.

    ``stop`` is an ``asyncio.Event`` set by the signals. The handlers are installed again once
    serving (``on_ready``): an engine may install its own while it starts.
    """
    from sidecar.mock.command import write_ready

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()

        def handle_signals() -> None:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, stop.set)

        def on_ready(info: ServingInfo) -> None:
            handle_signals()
            if ready_file:
                write_ready(ready_file, info)

        handle_signals()
        await serve(stop=stop, on_ready=on_ready)

    try:
        asyncio.run(main())
    except OSError as err:
        raise CommandError(f"cannot serve on {listen}: {err}") from None


def adapter_options(command: str, engine: str) -> Callable[[F], F]:
    """The flags every adapter command takes, around its engine's own (``engine``: its name in
    the help): the model and how it is served (``--model``, ``--build-tiny-model``, ``--listen``,
    ``--served-model-name``, ``--seed``, ``--max-logprobs``), its KV event publisher
    (``--kv-*``), ``--instance-id`` and ``--ready-file``."""
    opt = command_option(command)
    first = [
        opt(
            "--model",
            required=True,
            type=click.Path(file_okay=False, path_type=Path),
            help="Local model directory.",
        ),
        opt(
            "--build-tiny-model",
            is_flag=True,
            help="First build a tiny random-weight Llama in --model unless one is there (sidecar.engines.vllm.tiny_model).",
        ),
        opt(
            "--listen",
            default="127.0.0.1:50051",
            show_default=True,
            callback=check_listen,
            help="HOST:PORT or unix:///PATH.",
        ),
        opt(
            "--served-model-name",
            "served_model_names",
            multiple=True,
            help="Served name; repeat for aliases.",
        ),
    ]
    last = [
        opt(
            "--max-logprobs",
            type=click.IntRange(0),
            default=20,
            show_default=True,
            help="Most logprobs per token.",
        ),
        opt("--seed", type=int, default=0, show_default=True, help="Engine-wide generation seed."),
        opt(
            "--kv-events/--no-kv-events",
            default=True,
            show_default=True,
            help=f"{engine}'s ZMQ KV event publisher.",
        ),
        opt(
            "--kv-host",
            type=HostName(empty_ok=True),
            default="",
            help="Routable host advertised for the KV publisher (default: the listen host).",
        ),
        opt(
            "--kv-port",
            type=click.IntRange(0, 65535),
            default=0,
            show_default=True,
            help="0 = any free port.",
        ),
        opt(
            "--kv-replay-port",
            type=click.IntRange(0, 65535),
            default=0,
            show_default=True,
            help="0 = any free port.",
        ),
        opt("--kv-topic", default="", help="ZMQ topic of the KV events."),
        opt(
            "--kv-buffer-steps",
            type=click.IntRange(1),
            default=10_000,
            show_default=True,
            help="Replay buffer.",
        ),
        opt(
            "--instance-id",
            default="",
            help="Instance id to report (default: random).",
        ),
        opt(
            "--ready-file",
            type=NewFile(allow_dash=True),
            default=None,
            help="Write serving info (JSON) here once serving; '-' = stdout.",
        ),
    ]

    def around(own: F) -> F:
        """``own`` carries the engine's own flags; the shared ones go before and after them."""
        for decorate in reversed(last):
            own = decorate(own)
        for decorate in reversed(first):
            own = decorate(own)
        return own

    return around


def prepare_model(kw: dict[str, Any], extra: str, extra_missing: str) -> tuple[Path, Any]:
    """Pop ``--model``, ``--build-tiny-model`` and ``--ready-file`` from ``kw``: a model directory
    without ``config.json`` is a usage error whether or not the extra is installed; then the extra
    must be (exit 1 with ``extra_missing``); then the tiny model is built when asked. Returns the
    model directory and the ready file."""
    model: Path = kw.pop("model")
    build = kw.pop("build_tiny_model")
    if not build:
        check_model_dir(model)
    require_extra(extra, extra_missing)
    if build:
        from sidecar.engines.vllm.tiny_model import build_tiny_model

        try:
            build_tiny_model(model)
        except FileExistsError as err:
            raise click.BadParameter(str(err), param_hint="--model") from None
        check_model_dir(model)
    return model, kw.pop("ready_file")
