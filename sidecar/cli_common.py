"""The options every subcommand takes, before or after its name: ``--log-level``,
``--log-format`` and ``--config FILE``.

``--config FILE`` is a TOML file with the same keys as the flags (without ``--``); top-level
``log-level`` / ``log-format``, and one table per subcommand::

    log-format = "json"

    [run]
    engine = "unix:///run/openengine/engine.sock"
    listen = "0.0.0.0:8600"
    drain-timeout = 20
    kv-events = true            # a --flag/--no-flag pair: true or false

Precedence: a flag on the command line, then its environment variable, then the file, then the
default (click's ``default_map``). A key that is not a flag of that subcommand, a table of an
unknown subcommand or an unreadable file is a usage error (exit 2) naming it; values go through
the flag's own type and checks.
"""

from __future__ import annotations

import tomllib
from typing import Any

import click

from sidecar.logs import FORMATS, LEVELS, setup_logging

ENV_PREFIX = "OPENENGINE_SIDECAR_"

#: The start of every error line the CLI prints: usage errors and operational failures alike.
ERROR_PREFIX = "openengine-sidecar: "


def error_line(message: str) -> str:
    """``message`` as the CLI's one error line (:data:`ERROR_PREFIX`, whitespace runs folded)."""
    return ERROR_PREFIX + " ".join(message.split())


class CommandError(click.ClickException):
    """An operational failure of a subcommand (not a usage error): ``sidecar.cli`` prints it as
    one :func:`error_line` on stderr and exits with ``exit_code`` (1 unless given)."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code  # type: ignore[misc]  # click declares it a ClassVar


class Option(click.Option):
    """A ``click.Option`` whose errors say where a bad value came from: the environment
    variable or the config file (``--config``); a flag on the command line needs no note.
    A number range reads ``INTEGER`` or ``FLOAT`` in the help (click's ``INTEGER RANGE``
    pushed the text of most flags onto the next line); the range itself is still shown."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.metavar is None and isinstance(self.type, click.IntRange | click.FloatRange):
            self.metavar = self.type.name.upper().removesuffix(" RANGE")

    def get_error_hint(self, ctx: click.Context | None) -> str:
        hint = " / ".join(f"'{x}'" for x in self.opts or [self.human_readable_name])
        source = ctx.get_parameter_source(self.name) if ctx is not None and self.name else None
        if source is click.core.ParameterSource.ENVIRONMENT and self.envvar:
            names = [self.envvar] if isinstance(self.envvar, str) else list(self.envvar)
            return f"{hint} (from {' or '.join(names)})"
        if source is click.core.ParameterSource.DEFAULT_MAP:
            return f"{hint} (from the config file)"
        return hint


#: Top-level keys of a config file besides the subcommand tables.
GLOBAL_KEYS = {"log-level": "log_level", "log-format": "log_format"}

_RANK = {
    click.core.ParameterSource.COMMANDLINE: 3,
    click.core.ParameterSource.ENVIRONMENT: 2,
    click.core.ParameterSource.DEFAULT_MAP: 1,
    click.core.ParameterSource.DEFAULT: 0,
}


def _load(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as err:
        raise click.BadParameter(f"{path!r}: {err.strerror or err}") from None
    except tomllib.TOMLDecodeError as err:
        raise click.BadParameter(f"{path!r} is not valid TOML: {err}") from None


def _flag_names(command: click.Command) -> dict[str, str]:
    """Config key (long flag without ``--``) -> parameter name, for ``command``'s options."""
    keys: dict[str, str] = {}
    for param in command.params:
        if isinstance(param, click.Option) and param.name and param.expose_value:
            for opt in param.opts:
                if opt.startswith("--"):
                    keys[opt[2:]] = param.name
    return keys


def default_map(data: dict[str, Any], command: click.Command, name: str, path: str) -> dict[str, Any]:
    """``command``'s click ``default_map`` from a loaded config file (validated: see module doc)."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if key in GLOBAL_KEYS:
            out[GLOBAL_KEYS[key]] = value
        elif not isinstance(value, dict):
            known = ", ".join(sorted(GLOBAL_KEYS))
            raise click.BadParameter(
                f"{path!r}: unknown top-level key {key!r} (top level: {known}, then [subcommand] tables)"
            )
    table = data.get(name, {})
    flags = _flag_names(command)
    for key, value in table.items():
        if key in GLOBAL_KEYS:
            out[GLOBAL_KEYS[key]] = value
            continue
        if key not in flags:
            raise click.BadParameter(f"{path!r}: [{name}] has no key {key!r} (not a flag of '{name}')")
        if isinstance(value, dict):
            raise click.BadParameter(f"{path!r}: [{name}] {key} must be a value, not a table")
        out[flags[key]] = value
    return out


def _config_callback(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    """Eager: load the file and set this context's ``default_map`` before other options are read."""
    if ctx.resilient_parsing:
        return
    parent = ctx.parent
    loaded = parent.meta.get("openengine_sidecar.config") if parent is not None else None
    explicit = ctx.get_parameter_source("config") is click.core.ParameterSource.COMMANDLINE
    if loaded is not None and not explicit:
        path, data = loaded  # given before the subcommand (or both read the variable)
    elif value is None:
        return
    else:
        path, data = value, _load(value)
    if parent is None:  # the group: keep it for the subcommand; check the table names now
        group = ctx.command
        assert isinstance(group, click.Group)
        names = group.list_commands(ctx)
        for key, val in data.items():
            if isinstance(val, dict) and key not in names:
                raise click.BadParameter(f"{path!r}: [{key}] is not a subcommand ({', '.join(names)})")
        ctx.meta["openengine_sidecar.config"] = (path, data)
        ctx.default_map = {v: data[k] for k, v in GLOBAL_KEYS.items() if k in data}
        return
    name = ctx.info_name or ctx.command.name or ""
    ctx.default_map = default_map(data, ctx.command, name, path)


def _logging_callback(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    """Record this context's value and (re)configure logging with the effective ones.

    Given on both sides of the subcommand, the one from the more explicit source wins
    (command line, environment, config file, default); on a tie the subcommand's."""
    if ctx.resilient_parsing or param.name is None:
        return
    source = ctx.get_parameter_source(param.name)
    depth = 0
    parent = ctx.parent
    while parent is not None:
        depth, parent = depth + 1, parent.parent
    seen: dict[tuple[str, int], tuple[int, str]] = ctx.meta.setdefault("openengine_sidecar.logging", {})
    seen[(param.name, depth)] = (_RANK.get(source, 0) if source is not None else 0, str(value))

    def effective(name: str, default: str) -> str:
        candidates = [(rank, d, v) for (n, d), (rank, v) in seen.items() if n == name]
        return max(candidates)[2] if candidates else default

    setup_logging(effective("log_level", "info"), effective("log_format", "text"))


def common_options() -> list[click.Option]:
    """Fresh ``--log-level``, ``--log-format`` and ``--config`` options (one set per command)."""
    return [
        Option(
            ["--config"],
            type=click.Path(dir_okay=False),
            is_eager=True,
            expose_value=False,
            callback=_config_callback,
            envvar=ENV_PREFIX + "CONFIG",
            show_envvar=True,
            metavar="FILE",
            help="TOML file of flag values (a [subcommand] table, keys = flag names).",
        ),
        Option(
            ["--log-level"],
            type=click.Choice(LEVELS),
            default="info",
            show_default=True,
            expose_value=False,
            callback=_logging_callback,
            envvar=ENV_PREFIX + "LOG_LEVEL",
            show_envvar=True,
            help="Least severe log records written (to stderr).",
        ),
        Option(
            ["--log-format"],
            type=click.Choice(FORMATS),
            default="text",
            show_default=True,
            expose_value=False,
            callback=_logging_callback,
            envvar=ENV_PREFIX + "LOG_FORMAT",
            show_envvar=True,
            help="text: one line per record; json: one JSON object per line.",
        ),
    ]


def add_common_options(command: click.Command) -> click.Command:
    """Give ``command`` the common options (once; they go first in its help)."""
    if not getattr(command, "_openengine_sidecar_common", False):
        command.params[:0] = common_options()
        command._openengine_sidecar_common = True  # type: ignore[attr-defined]
    return command
