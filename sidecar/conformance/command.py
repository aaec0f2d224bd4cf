"""``openengine-sidecar conformance``: check a live engine against the OpenEngine rules.

Exit status: 0 when no check failed (skips are fine), 1 when at least one failed, 2 when
the suite could not run (bad arguments, an engine that cannot be reached), 130 when
interrupted. The check list and what each enforces: docs/CONFORMANCE.md.
"""

from __future__ import annotations

import json
import shutil
import sys
from typing import TextIO

import click
import trio

from sidecar.cli_common import CommandError
from sidecar.cli_options import ENGINE_ADDRESS, SECONDS, NewFile, absolute_path, command_option
from sidecar.conformance.context import SuiteOptions
from sidecar.conformance.progress import LineProgress
from sidecar.conformance.report import format_check_list, format_table
from sidecar.conformance.runner import Report, SuiteError, all_checks, run_suite

__all__ = ["conformance", "run_conformance"]

EXIT_FAILED = 1
EXIT_NOT_RUN = 2
EXIT_INTERRUPTED = 130

option = command_option("conformance")


async def run_conformance(options: SuiteOptions, out: TextIO) -> Report | SuiteError | ValueError:
    """Run the suite with live progress on ``out``; errors are returned, not raised."""
    try:
        return await run_suite(options, progress=LineProgress(out))
    except (SuiteError, ValueError) as err:
        return err


@click.command("conformance")
@option(
    "--engine",
    type=ENGINE_ADDRESS,
    default=None,
    metavar="ADDR",
    help="Engine to check: host:port, http://host:port or unix:///path.",
)
@option(
    "--model",
    default=None,
    metavar="NAME",
    help="Model to test with (default: the engine's first supported model).",
)
@option(
    "--prefill",
    type=ENGINE_ADDRESS,
    default=None,
    metavar="ADDR",
    help="Prefill engine of a P/D pair (with --decode): runs pd.handoff.",
)
@option(
    "--decode",
    type=ENGINE_ADDRESS,
    default=None,
    metavar="ADDR",
    help="Decode engine of a P/D pair (with --prefill).",
)
@option(
    "--only",
    multiple=True,
    metavar="PATTERN",
    help="Run only checks matching PATTERN (glob or group, repeatable).",
)
@option(
    "--skip",
    multiple=True,
    metavar="PATTERN",
    help="Skip checks matching PATTERN (glob or group, repeatable).",
)
@option(
    "--json",
    "json_path",
    default=None,
    metavar="REPORT",
    type=NewFile(allow_dash=True),
    help="Write the JSON report to REPORT ('-' = stdout; the table then goes to stderr).",
)
@option(
    "--destructive",
    is_flag=True,
    default=False,
    help="Also run the drain checks: the engine stops accepting work for good.",
)
@option(
    "--lora-path",
    default=None,
    callback=absolute_path,
    metavar="PATH",
    help="Absolute adapter directory the engine can load (lora.lifecycle).",
)
@option(
    "--check-timeout",
    type=SECONDS,
    default=None,
    help="Seconds allowed per check (default: each check's own).",
)
@option(
    "--connect-timeout", type=SECONDS, default=5.0, show_default=True, help="Seconds to reach each engine."
)
@option("--list", "list_only", is_flag=True, default=False, help="List the checks and exit.")
def conformance(
    engine: str | None,
    model: str | None,
    prefill: str | None,
    decode: str | None,
    only: tuple[str, ...],
    skip: tuple[str, ...],
    json_path: str | None,
    destructive: bool,
    lora_path: str | None,
    check_timeout: float | None,
    connect_timeout: float,
    list_only: bool,
) -> None:
    """Check that an engine keeps the OpenEngine contract the sidecar relies on."""
    width = min(shutil.get_terminal_size((100, 24)).columns, 120)
    if list_only:
        click.echo(format_check_list(all_checks(), width=width))
        return
    if bool(prefill) != bool(decode):
        raise click.UsageError("--prefill and --decode go together")
    if not engine and not prefill:
        raise click.UsageError("give --engine ADDR (and/or --prefill ADDR --decode ADDR)")
    options = SuiteOptions(
        engine=engine,
        model=model,
        prefill=prefill,
        decode=decode,
        only=only,
        skip=skip,
        destructive=destructive,
        lora_path=lora_path,
        check_timeout=check_timeout,
        connect_timeout=connect_timeout,
    )
    human = sys.stderr if json_path == "-" else sys.stdout
    try:
        outcome = trio.run(run_conformance, options, human)
    except KeyboardInterrupt:
        human.write("\n")  # past the progress line
        raise CommandError("interrupted", EXIT_INTERRUPTED) from None
    if isinstance(outcome, SuiteError | ValueError):
        raise CommandError(str(outcome), EXIT_NOT_RUN)
    human.write("\n" + format_table(outcome, width=width) + "\n")
    human.flush()
    if json_path:
        text = json.dumps(outcome.to_json(), indent=2)
        if json_path == "-":
            click.echo(text)
        else:
            with open(json_path, "w", encoding="utf-8") as f:
                f.write(text + "\n")
    sys.exit(EXIT_FAILED if outcome.failed else 0)
