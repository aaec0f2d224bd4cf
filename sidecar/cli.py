"""``openengine-sidecar`` command line (also ``python -m sidecar``).

Subcommands live beside the code they drive and are imported lazily, so
``openengine-sidecar --help`` stays fast and one broken optional part (e.g. the
Dynamo extra) never breaks the others.
"""

from __future__ import annotations

import importlib
import logging
import os

import click

from sidecar.cli_options import option

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
        return command


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


def setup_logging(level: str) -> None:
    """One line per record on stderr: time, level, logger, message."""
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # The wire-level loggers under grpclib log every header value at DEBUG (routing keys,
    # application metadata): never let --log-level debug put request metadata in the logs.
    for name in ("hpack", "h2"):
        logging.getLogger(name).setLevel(max(logging.INFO, logging.getLogger().level))


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--version",
    is_flag=True,
    expose_value=False,
    is_eager=True,
    callback=_print_version,
    help="Show the version, source commit and OpenEngine schema release, and exit.",
)
@option("--log-level", default="info", type=click.Choice(["debug", "info", "warning", "error"]))
def main(log_level: str) -> None:
    """Engine-neutral sidecar for OpenEngine v1 inference engines."""
    setup_logging(log_level)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
