"""``openengine-sidecar`` command line (also ``python -m sidecar``).

Subcommands live beside the code they drive and are imported lazily, so
``openengine-sidecar --help`` stays fast and one broken optional part (e.g. the
Dynamo extra) never breaks the others. Every subcommand also takes the common options of
:mod:`sidecar.cli_common` (``--log-level``, ``--log-format``, ``--config``), before or after
its name.

Exit status: 0 success, 1 a runtime failure (one line on stderr saying what), 2 a usage
error — a bad flag value, a missing option, an unreadable config file, an unknown subcommand
(with the nearest name as a suggestion) — reported as one line naming the flag, before anything
starts (some subcommands document more, e.g. 130 after Ctrl-C). Every error line starts with
``openengine-sidecar: `` (:data:`sidecar.cli_common.ERROR_PREFIX`).
"""

from __future__ import annotations

import difflib
import importlib
import os
import sys
from collections.abc import Sequence
from typing import Any

import click

from sidecar.cli_common import add_common_options, common_options, error_line

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
        if command.epilog is None:  # once per command object
            from sidecar.cli_help import env_epilog
            from sidecar.cli_options import COMMAND_ENV, ENV_PREFIX

            command.epilog = env_epilog(command, ENV_PREFIX + COMMAND_ENV[cmd_name])
        return add_common_options(command)

    def resolve_command(
        self, ctx: click.Context, args: list[str]
    ) -> tuple[str | None, click.Command | None, list[str]]:
        """The subcommand; an unknown name is a usage error suggesting the nearest one."""
        name = args[0] if args else ""
        if name and not name.startswith("-") and name not in SUBCOMMANDS:
            guess = suggest(name, self.list_commands(ctx))
            if guess is not None:
                raise click.UsageError(f"No such command {name!r}. Did you mean {guess!r}?", ctx)
        return super().resolve_command(ctx, args)

    def main(  # type: ignore[override]
        self, args: Sequence[str] | None = None, prog_name: str | None = None, **extra: Any
    ) -> Any:
        """Run the CLI; a usage error or a ``ClickException`` is one line on stderr (exit 2 or 1)."""
        extra.pop("standalone_mode", None)
        try:
            return super().main(args, prog_name, standalone_mode=False, **extra)
        except click.UsageError as err:
            if _NO_ARGS_IS_HELP is not None and isinstance(err, _NO_ARGS_IS_HELP):
                err.show()  # the group's help, as click prints it (no subcommand given)
                sys.exit(err.exit_code)
            ctx = err.ctx
            hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
            click.echo(error_line(err.format_message()) + hint, err=True)
            sys.exit(err.exit_code)
        except click.ClickException as err:
            click.echo(error_line(err.format_message()), err=True)
            sys.exit(err.exit_code)
        except click.exceptions.Abort:  # Ctrl-C outside a subcommand's own handling
            click.echo(error_line("interrupted"), err=True)
            sys.exit(130)


#: click >= 8.2 raises this for a group run without a subcommand (its message is the whole help).
_NO_ARGS_IS_HELP: type[click.UsageError] | None = getattr(click.exceptions, "NoArgsIsHelpError", None)


def suggest(name: str, names: list[str]) -> str | None:
    """The one of ``names`` that ``name`` most likely misspells or abbreviates, or None."""
    prefixed = [n for n in names if n.startswith(name)]
    if len(prefixed) == 1:
        return prefixed[0]
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
    return close[0] if close else None


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
@click.group(
    cls=LazyGroup,
    # help up to 100 columns on a terminal that wide (click's default stops at 80)
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
)
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
