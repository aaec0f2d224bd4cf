"""``openengine-sidecar`` command line (also ``python -m sidecar``).

Subcommands live beside the code they drive and are imported lazily, so
``openengine-sidecar --help`` stays fast and one broken optional part (e.g. the
Dynamo extra) never breaks the others. Every subcommand also takes the common options of
:mod:`sidecar.cli_common` (``--log-level``, ``--log-format``, ``--config``), before or after
its name.

Exit status: 0 success, 1 a runtime failure (one line on stderr saying what), 2 a usage
error — a bad flag value, a missing option, an unreadable config file — reported as one line
naming the flag, before anything starts (some subcommands document more, e.g. 130 after
Ctrl-C).
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Sequence
from typing import Any

import click

from sidecar.cli_common import add_common_options, common_options

#: subcommand -> "module:attribute" of a click.Command
SUBCOMMANDS: dict[str, str] = {
    "run": "sidecar.run_command:run",
    "describe": "sidecar.core.describe_command:describe",
    "generate": "sidecar.client.commands:generate",
    "disagg": "sidecar.client.commands:disagg",
    "mock-engine": "sidecar.mock.command:mock_engine",
    "conformance": "sidecar.conformance.command:conformance",
    "bench": "sidecar.bench.command:bench",
    "vllm-engine": "sidecar.engines.vllm.command:vllm_engine",
    "sglang-engine": "sidecar.engines.sglang.command:sglang_engine",
}


class LazyGroup(click.Group):
    """A group whose subcommands are imported on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(SUBCOMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        target = SUBCOMMANDS.get(cmd_name)
        if target is None:
            return None
        module_name, attr = target.split(":")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if err.name and module_name.startswith(err.name):
                return _unavailable(cmd_name)
            raise
        command = getattr(module, attr)
        assert isinstance(command, click.Command)
        return add_common_options(command)

    def main(  # type: ignore[override]
        self, args: Sequence[str] | None = None, prog_name: str | None = None, **extra: Any
    ) -> Any:
        """Run the CLI; a usage error or a ``ClickException`` is one line on stderr (exit 2 or 1)."""
        extra.pop("standalone_mode", None)
        try:
            return super().main(args, prog_name, standalone_mode=False, **extra)
        except click.UsageError as err:
            ctx = err.ctx
            where = ctx.command_path if ctx is not None else (prog_name or "openengine-sidecar")
            hint = f" (see '{where} --help')" if ctx is not None else ""
            click.echo(f"{where}: {_one_line(err.format_message())}{hint}", err=True)
            sys.exit(err.exit_code)
        except click.ClickException as err:
            click.echo(f"openengine-sidecar: {_one_line(err.format_message())}", err=True)
            sys.exit(err.exit_code)
        except click.exceptions.Abort:  # Ctrl-C outside a subcommand's own handling
            click.echo("openengine-sidecar: interrupted", err=True)
            sys.exit(130)


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _unavailable(name: str) -> click.Command:
    @click.command(name, help="(not available in this build)")
    def _cmd() -> None:
        raise click.ClickException(f"'{name}' is not available in this build")

    return _cmd


def _print_version(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    """``--version``: package version, source commit, OpenEngine schema release (sidecar.version)."""
    if not value or ctx.resilient_parsing:
        return
    from sidecar.version import version_text

    click.echo(version_text())
    ctx.exit()


def _with_common_options(group: click.Group) -> click.Group:
    group.params.extend(common_options())
    return group


@_with_common_options
@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--version",
    is_flag=True,
    expose_value=False,
    is_eager=True,
    callback=_print_version,
    help="Show the version, source commit and OpenEngine schema release, and exit.",
)
def main() -> None:
    """Engine-neutral sidecar for OpenEngine v1 inference engines."""
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
