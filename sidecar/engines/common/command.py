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
from typing import Any

import click

from sidecar.addresses import parse_listen
from sidecar.cli_common import CommandError
from sidecar.mock.app import ServingInfo

Serve = Callable[..., Awaitable[None]]


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
