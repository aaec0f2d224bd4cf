"""``--help`` reads in one sitting: ``run``'s flags in titled sections, short help lines, one
sentence for the environment variables instead of one per flag (real processes at 80 columns,
as a terminal shows them)."""

from __future__ import annotations

import re

import click
import pytest

from sidecar.cli import SUBCOMMANDS, main
from sidecar.cli_help import OTHER, RUN_SECTIONS, SectionedCommand
from sidecar.cli_options import COMMAND_ENV, ENV_PREFIX
from tests.cli.helpers import clean_env, cli


def _command(name: str) -> click.Command:
    command = main.get_command(click.Context(main), name)
    assert command is not None
    return command


def test_every_run_flag_has_a_section_and_every_pattern_a_flag() -> None:
    run = _command("run")
    assert isinstance(run, SectionedCommand)
    ctx = click.Context(run, info_name="run")
    sections = run.sectioned(ctx)
    titles = [title for title, _ in sections]
    assert OTHER not in titles, [p.opts for t, ps in sections if t == OTHER for p in ps]
    assert titles == [title for title, _ in RUN_SECTIONS]  # none empty
    placed = [p.name for _, params in sections for p in params]
    options = [p.name for p in run.get_params(ctx) if isinstance(p, click.Option)]
    assert sorted(placed) == sorted(options)  # each once
    for title, patterns in RUN_SECTIONS:
        flags = {f for t, params in sections if t == title for p in params for f in p.opts}
        for pattern in patterns:
            assert any(re.fullmatch(pattern.replace("*", ".*"), f) for f in flags), (title, pattern)


async def test_run_help_is_grouped_short_and_names_every_flag() -> None:
    done = await cli("run", "--help", env=clean_env(COLUMNS="80"))
    assert done.code == 0, done.err
    lines = done.out.splitlines()
    assert len(lines) <= 250, len(lines)  # was 363, one list of 80 flags
    headings = [line[:-1] for line in lines if line.endswith(":") and not line.startswith(" ")]
    assert headings == [title for title, _ in RUN_SECTIONS]
    run = _command("run")
    for param in run.params:
        for flag in param.opts + param.secondary_opts:
            assert re.search(rf"(^|[\s/]){re.escape(flag)}\b", done.out), flag
    # one help column for every section
    columns = {
        len(line) - len(line[2:].split("  ", 1)[1].lstrip())
        for line in lines
        if line.startswith("  -") and "  " in line.strip()
    }
    assert len(columns) == 1, columns
    # the per-flag variables are one sentence at the end; Dynamo's own are named in its flags
    assert "[env var: OPENENGINE_SIDECAR_MAX_STREAMS" not in done.out
    assert "OPENENGINE_SIDECAR_<FLAG> (--engine: OPENENGINE_SIDECAR_ENGINE) unless" in " ".join(
        done.out.split()
    )
    assert "DYN_NAMESPACE" in done.out


@pytest.mark.parametrize("name", sorted(set(SUBCOMMANDS) - {"run"}))
def test_every_subcommand_states_its_variables_once(name: str) -> None:
    command = _command(name)
    ctx = click.Context(command, info_name=name, parent=click.Context(main, info_name="openengine-sidecar"))
    text = command.get_help(ctx)
    prefix = ENV_PREFIX + COMMAND_ENV[name]
    assert f"{prefix}<FLAG>" in " ".join(text.split()), text
    assert f"[env var: {prefix}" not in text, text
