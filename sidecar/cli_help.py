"""How the CLI's ``--help`` reads: options in titled sections, and one sentence for the
environment variables instead of one per flag.

click has no option groups of its own; :class:`SectionedCommand` only changes how the help is
laid out (click's ``format_options``), so the options themselves — their classes, decorators,
environment variables and config-file keys — stay plain click options wherever they are defined.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from typing import Any

import click

#: Title of the section for options no pattern names (``run`` has none: a test keeps it so).
OTHER = "Other options"

#: ``run``'s sections: (title, flag patterns). An option goes to the first section with a
#: pattern matching its first long flag (``fnmatch``); in a section, patterns order the options.
RUN_SECTIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "Engine",
        (
            "--engine",
            "--model",
            "--expected-engine",
            "--expected-schema-release",
            "--require-known-release",
            "--handoff-profile",
            "--startup-deadline",
            "--health-interval",
            "--call-timeout",
            "--load-interval",
            "--engine-*",
        ),
    ),
    (
        "Listeners",
        (
            "--listen",
            "--http-listen",
            "--openai-listen",
            "--chat-template",
            "--tls-cert",
            "--tls-key",
            "--auth-token-file",
            "--open-probes",
            "--ready-file",
        ),
    ),
    (
        "Streams",
        (
            "--max-streams",
            "--max-streams-per-connection",
            "--peer-stream-share",
            "--first-event-timeout",
            "--inactivity-timeout",
            "--abort-*",
            "--max-undelivered-aborts",
            "--max-request-id-length",
            "--lora-root",
        ),
    ),
    (
        "Client limits",
        (
            "--max-connections",
            "--max-connections-per-peer",
            "--handshake-timeout",
            "--stall-timeout",
            "--max-message-size",
            "--max-calls-per-connection",
            "--max-pending-bytes",
            "--client-engine-calls*",
            "--http-*",
        ),
    ),
    ("Stopping", ("--drain-timeout", "--drain-engine")),
    ("KV event bridge", ("--kv-*",)),
    ("Dynamo (the 'dynamo' extra)", ("--dynamo*",)),
    ("Tracing", ("--otlp-*",)),
    ("Logging and configuration", ("--log-*", "--config", "--help")),
)


#: click's own bound on the width of the flags' column.
_COL_MAX = 30


def _flag(param: click.Parameter) -> str:
    return next((o for o in param.opts if o.startswith("--")), param.opts[0] if param.opts else "")


class SectionedCommand(click.Command):
    """A ``click.Command`` whose help lists its options under ``sections`` (see
    :data:`RUN_SECTIONS`); options no pattern matches are listed last, under :data:`OTHER`."""

    def __init__(self, *args: Any, sections: Sequence[tuple[str, Sequence[str]]] = (), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sections = tuple((title, tuple(patterns)) for title, patterns in sections)

    def sectioned(self, ctx: click.Context) -> list[tuple[str, list[click.Parameter]]]:
        """(title, options) in help order, empty sections left out."""
        left: list[click.Parameter] = [p for p in self.get_params(ctx) if isinstance(p, click.Option)]
        out: list[tuple[str, list[click.Parameter]]] = []
        for title, patterns in self.sections:
            taken: list[click.Parameter] = []
            for pattern in patterns:
                taken += [p for p in left if p not in taken and fnmatch.fnmatchcase(_flag(p), pattern)]
            left = [p for p in left if p not in taken]
            out.append((title, taken))
        out.append((OTHER, left))
        return [(title, params) for title, params in out if params]

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        sections = [
            (title, [r for r in (p.get_help_record(ctx) for p in params) if r is not None])
            for title, params in self.sectioned(ctx)
        ]
        # one column for the help texts of every section (click sizes it per list)
        width = min(max((len(term) for _, records in sections for term, _ in records), default=0), _COL_MAX)
        for title, records in sections:
            if records:
                with formatter.section(title):
                    formatter.write_dl(
                        [(term.ljust(width) if text else term, text) for term, text in records], _COL_MAX
                    )


def env_epilog(command: click.Command, prefix: str) -> str:
    """The sentence that stands for the per-flag environment variables of ``command`` (whose
    variables are ``prefix`` + the long flag in capitals, dashes as underscores)."""
    example = next(
        (
            _flag(p)
            for p in command.params
            if isinstance(p, click.Option)
            and _flag(p).startswith("--")
            and not p.is_flag
            and p.name not in ("config", "log_level", "log_format")
        ),
        None,
    )
    if example is None:
        return ""
    variable = prefix + example[2:].replace("-", "_").upper()
    return (
        f"Every flag also reads an environment variable: {prefix}<FLAG> ({example}: {variable}) "
        "unless its help names another. A flag given wins over its variable, the variable over --config."
    )
