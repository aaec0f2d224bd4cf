"""Shared click helpers: every long flag also reads ``OPENENGINE_SIDECAR_<FLAG>``.

``--drain-timeout`` reads ``OPENENGINE_SIDECAR_DRAIN_TIMEOUT``, so a systemd
``EnvironmentFile`` or a container ``env:`` configures any subcommand.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

ENV_PREFIX = "OPENENGINE_SIDECAR_"


def env_name(flag: str) -> str:
    """Environment variable for a long flag (``--kv-publish`` -> ``OPENENGINE_SIDECAR_KV_PUBLISH``)."""
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


def option(*decls: str, **kwargs: Any):  # type: ignore[no-untyped-def]
    """``click.option`` that also reads the flag's ``OPENENGINE_SIDECAR_*`` variable."""
    longs = [d for d in decls if d.startswith("--")]
    if longs and "envvar" not in kwargs:
        kwargs["envvar"] = env_name(longs[0].split("/")[0])
        kwargs.setdefault("show_envvar", True)
    return click.option(*decls, **kwargs)


def read_token_file(path: str | None) -> str | None:
    """The bearer token in ``path`` (surrounding whitespace stripped), or None without a path."""
    if not path:
        return None
    with open(path) as f:
        return f.read().strip()


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
