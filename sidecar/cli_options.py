"""Shared click helpers: environment variables, and the parameter types every subcommand uses.

Environment variables: every long flag also reads a variable, one name per meaning:

- ``run`` (the service) and the options every subcommand takes (``--log-level``,
  ``--log-format``, ``--config``): ``OPENENGINE_SIDECAR_<FLAG>`` — ``--drain-timeout`` reads
  ``OPENENGINE_SIDECAR_DRAIN_TIMEOUT``, so a systemd ``EnvironmentFile`` or a container
  ``env:`` configures the service;
- every other subcommand: ``OPENENGINE_SIDECAR_<COMMAND>_<FLAG>`` (:data:`COMMAND_ENV`), e.g.
  ``OPENENGINE_SIDECAR_CONFORMANCE_JSON``, ``OPENENGINE_SIDECAR_MOCK_LISTEN``: a variable set for
  the service never configures a client, a test engine or the benchmark started from the same
  environment. :func:`command_option` builds a subcommand's ``option``.

Parameter types validate at parse time, so a bad value exits 2 with one line naming the flag
(``sidecar.cli``) before anything starts: :data:`SECONDS` / :data:`SECONDS_OR_ZERO`,
:class:`ListenAddressType`, :class:`EngineAddressType`, :class:`NewFile` (its directory must
exist), and :func:`read_token` for token files.
"""

from __future__ import annotations

import ipaddress
import math
import os
import re
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import click

from sidecar.addresses import parse_listen
from sidecar.cli_common import ENV_PREFIX, Option

#: Per-subcommand infix of the environment variables (``run``'s flags have none).
COMMAND_ENV: dict[str, str] = {
    "run": "",
    "describe": "DESCRIBE_",
    "generate": "GENERATE_",
    "disagg": "DISAGG_",
    "conformance": "CONFORMANCE_",
    "mock-engine": "MOCK_",
    "vllm-engine": "VLLM_",
    "sglang-engine": "SGLANG_",
    "bench": "BENCH_",
}


def env_name(flag: str, command: str = "run") -> str:
    """Environment variable of a long flag of ``command``.

    ``env_name("--kv-publish")`` is ``OPENENGINE_SIDECAR_KV_PUBLISH``;
    ``env_name("--json", "conformance")`` is ``OPENENGINE_SIDECAR_CONFORMANCE_JSON``.
    """
    infix = COMMAND_ENV.get(command, command.replace("-", "_").upper() + "_")
    return ENV_PREFIX + infix + flag.lstrip("-").replace("-", "_").upper()


FC = TypeVar("FC", bound=Callable[..., Any] | click.Command)


class OptionDecorator(Protocol):
    """``click.option``'s signature (what :func:`command_option` returns)."""

    def __call__(self, *decls: str, **kwargs: Any) -> Callable[[FC], FC]: ...


def command_option(command: str) -> OptionDecorator:
    """The ``option`` decorator of ``command``: ``click.option`` that also reads the flag's
    variable (:func:`env_name`; the help says so once, ``sidecar.cli_help.env_epilog``, not per
    flag); an explicit ``envvar=`` is kept and shown in the flag's help."""

    def option(*decls: str, **kwargs: Any) -> Callable[[FC], FC]:
        longs = [d for d in decls if d.startswith("--")]
        if "envvar" in kwargs:
            kwargs.setdefault("show_envvar", True)
        elif longs:
            kwargs["envvar"] = env_name(longs[0].split("/")[0], command)
        kwargs.setdefault("cls", Option)
        return click.option(*decls, **kwargs)

    return option


#: ``run``'s option decorator (``OPENENGINE_SIDECAR_<FLAG>``).
option = command_option("run")


# --------------------------------------------------------------------------- numbers


class Seconds(click.FloatRange):
    """A finite number of seconds: ``> 0``, or ``>= 0`` with ``zero_ok`` (0 then means "none")."""

    name = "seconds"

    def __init__(self, *, zero_ok: bool = False) -> None:
        super().__init__(min=0, min_open=not zero_ok)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        rv = super().convert(value, param, ctx)
        if not math.isfinite(rv):
            self.fail(f"{value!r} is not a finite number of seconds", param, ctx)
        return rv


#: Seconds, more than zero.
SECONDS = Seconds()
#: Seconds, zero or more (zero: the bound is off; say so in the help).
SECONDS_OR_ZERO = Seconds(zero_ok=True)
#: A count of at least one.
COUNT = click.IntRange(min=1)


# --------------------------------------------------------------------------- addresses


class ListenAddressType(click.ParamType):
    """A listener's ``HOST:PORT`` (port 0: any free port); ``unix_ok`` also takes ``unix:///PATH``
    (its directory must exist). Parsed by :func:`sidecar.addresses.parse_listen`, the servers'
    own parser. The value stays the text given (validated)."""

    name = "host:port"

    def __init__(self, *, unix_ok: bool = False) -> None:
        self.unix_ok = unix_ok
        if unix_ok:
            self.name = "host:port|unix:///path"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        text = str(value).strip()
        unix = text.startswith("unix:")
        if (unix and not self.unix_ok) or ("://" in text and not unix):
            forms = "HOST:PORT or unix:///PATH" if self.unix_ok else "HOST:PORT"
            self.fail(f"{text!r}: expected {forms}", param, ctx)
        try:
            address = parse_listen(text)
        except ValueError as err:
            self.fail(str(err), param, ctx)
        if address.path is not None and not os.path.isdir(os.path.dirname(address.path)):
            self.fail(f"{text!r}: directory {os.path.dirname(address.path)!r} does not exist", param, ctx)
        return text


_LABEL = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")


class HostName(click.ParamType):
    """A host to bind or advertise: an IP address (IPv6 with or without brackets), ``*``, or a
    DNS name; no scheme, port or spaces. ``empty_ok``: an empty value (the flag's default) too."""

    name = "host"

    def __init__(self, *, empty_ok: bool = False) -> None:
        self.empty_ok = empty_ok

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        text = str(value).strip()
        bare = text[1:-1] if text.startswith("[") and text.endswith("]") else text
        if (not text and self.empty_ok) or bare == "*":
            return text
        try:
            ipaddress.ip_address(bare)
            return text
        except ValueError:
            pass
        labels = bare.removesuffix(".").split(".")
        if bare and len(bare) <= 253 and all(_LABEL.fullmatch(label) for label in labels):
            return text
        self.fail(f"{text!r}: expected an IP address or a host name", param, ctx)


class EngineAddressType(click.ParamType):
    """An OpenEngine engine address: ``host:port``, ``http://host:port`` or ``unix:///path``."""

    name = "address"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        from sidecar.openengine.address import parse_engine_address
        from sidecar.openengine.engine_errors import EngineConfigError

        try:
            parse_engine_address(str(value))
        except EngineConfigError as err:
            self.fail(str(err), param, ctx)
        return str(value).strip()


ENGINE_ADDRESS = EngineAddressType()


# --------------------------------------------------------------------------- files


class NewFile(click.Path):
    """A file the command writes: its directory must exist (checked before anything starts).
    ``-`` (stdout) when ``allow_dash``; ``create_dirs``: a missing directory is created later, so
    the nearest existing one must be a writable directory instead."""

    def __init__(self, *, allow_dash: bool = False, create_dirs: bool = False, **kw: Any) -> None:
        super().__init__(dir_okay=False, allow_dash=allow_dash, **kw)
        self.create_dirs = create_dirs

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        rv = super().convert(value, param, ctx)
        text = os.fsdecode(rv)
        if text == "-" and self.allow_dash:
            return rv
        directory = os.path.dirname(os.path.abspath(text))
        if self.create_dirs:
            _check_creatable(self, directory, text, param, ctx)
            return rv
        if not os.path.isdir(directory):
            self.fail(f"{text!r}: directory {directory!r} does not exist", param, ctx)
        if not os.access(directory, os.W_OK | os.X_OK):
            self.fail(f"{text!r}: directory {directory!r} is not writable", param, ctx)
        return rv


class NewDir(click.Path):
    """A directory the command creates (or reuses): the nearest existing one on its path must be a
    writable directory (checked before anything starts)."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(file_okay=False, **kw)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        rv = super().convert(value, param, ctx)
        text = os.fsdecode(rv)
        _check_creatable(self, os.path.abspath(text), text, param, ctx)
        return rv


def _check_creatable(
    kind: click.ParamType, directory: str, text: str, param: click.Parameter | None, ctx: click.Context | None
) -> None:
    """``directory`` exists as a writable directory, or can be made in its nearest existing one."""
    existing = directory
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        kind.fail(f"{text!r}: {existing!r} is not a directory", param, ctx)
    if not os.access(existing, os.W_OK | os.X_OK):
        kind.fail(f"{text!r}: directory {existing!r} is not writable", param, ctx)


#: An existing, readable file.
EXISTING_FILE = click.Path(exists=True, dir_okay=False, readable=True)


def read_token(ctx: click.Context, param: click.Parameter, path: str | None) -> str | None:
    """Callback of a token-file option: the token (surrounding whitespace stripped), or None
    without a path; an empty file is a usage error."""
    if not path:
        return None
    token = read_token_file(path)
    if not token:
        raise click.BadParameter(f"{path!r}: the token file is empty", ctx, param)
    return token


def read_token_file(path: str | None) -> str | None:
    """The bearer token in ``path`` (surrounding whitespace stripped), or None without a path."""
    if not path:
        return None
    with open(path) as f:
        return f.read().strip()


def absolute_path(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """Callback: ``value`` must be an absolute path (normalized); None passes."""
    if value is None:
        return None
    if not value.startswith("/"):
        raise click.BadParameter(f"{value!r}: must be an absolute path", ctx, param)
    return os.path.normpath(value)


def parsed(parse: Callable[[str], str]) -> Callable[[click.Context, click.Parameter, str | None], str | None]:
    """A click callback validating a value at parse time: ``parse`` normalizes it or raises
    ``ValueError``, which becomes a one-line usage error naming the flag."""

    def callback(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
        if value is None:
            return None
        try:
            return parse(value)
        except ValueError as err:
            raise click.BadParameter(str(err)) from None

    return callback
