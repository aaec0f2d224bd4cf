"""Shared facts for the deployment tests: repository paths, the CLI's defaults, tool lookup.

Defaults are read from the click command objects, so a changed CLI default makes the
deployment files' checks fail instead of silently drifting.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from sidecar.cli_common import common_options
from sidecar.core.shutdown import stop_timeout
from sidecar.dynamo.plane import LEAVE_TIMEOUT
from sidecar.run_command import run as run_command

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
LAUNCH = ROOT / "scripts" / "launch"


def run_default(name: str) -> Any:
    """Default of ``openengine-sidecar run``'s parameter ``name`` (python name, e.g. ``http_listen``)."""
    for param in run_command.params:
        if param.name == name:
            return param.default
    raise KeyError(name)


def run_env_vars() -> set[str]:
    """Every environment variable ``run`` (and the options every subcommand takes) reads."""
    names: set[str] = set()
    for param in [*common_options(), *run_command.params]:
        if isinstance(param, click.Option):
            env = param.envvar
            names.update([env] if isinstance(env, str) else list(env or ()))
    return names


def port_of(address: str) -> int:
    """Port of ``host:port`` or ``tcp://host:port``."""
    return int(address.rpartition(":")[2])


def default_ports() -> dict[str, int]:
    return {
        "ws": port_of(run_default("listen")),
        "http": port_of(run_default("http_listen")),
        "kv-pub": port_of(run_default("kv_publish")),
        "kv-replay": port_of(run_default("kv_replay")),
    }


def stop_budget(drain_timeout: float | None = None, *, dynamo: bool = False) -> float:
    """Seconds a stop may take (``sidecar.core.shutdown.stop_timeout``) with the default abort
    timeout; ``dynamo``: the Dynamo plane leaves discovery first."""
    drain = run_default("drain_timeout") if drain_timeout is None else drain_timeout
    leave = LEAVE_TIMEOUT + float(run_default("dynamo_unregister_grace")) if dynamo else 0.0
    return stop_timeout(float(drain), float(run_default("abort_timeout")), leave)
