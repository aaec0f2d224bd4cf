"""The Dynamo plane's command-line flags, for the ``run`` command.

Each flag reads ``OPENENGINE_SIDECAR_DYNAMO_*`` and then the ``DYN_*`` variable Dynamo's
own workers read (named in the flag's help) (``DYN_NAMESPACE``, ``DYN_DISCOVERY_BACKEND``, ``DYN_REQUEST_PLANE``,
``DYN_EVENT_PLANE``), so an existing Dynamo deployment's environment applies as is.
Other ``DYN_*`` variables (``DYN_FILE_KV``, ``ETCD_ENDPOINTS``, ``NATS_SERVER``,
``DYN_TCP_RPC_HOST`` …) are read by Dynamo's runtime itself.

Usage::

    @click.command()
    @dynamo_options
    def run(**kw):
        dynamo = dynamo_config(kw)   # None without --dynamo
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import click

from sidecar.cli_options import env_name, option
from sidecar.dynamo.config import (
    DISCOVERY_BACKENDS,
    EVENT_PLANES,
    REQUEST_PLANES,
    DynamoConfig,
    DynamoConfigError,
)

F = TypeVar("F", bound=Callable[..., Any])


def _envs(flag: str, dyn: str | None = None) -> list[str]:
    return [env_name(flag), dyn] if dyn else [env_name(flag)]


_OPTIONS = [
    option(
        "--dynamo/--no-dynamo",
        "dynamo",
        default=False,
        show_default=True,
        help="Also serve the engine to a Dynamo deployment.",
    ),
    option(
        "--dynamo-namespace",
        default="dynamo",
        show_default=True,
        envvar=_envs("--dynamo-namespace", "DYN_NAMESPACE"),
        show_envvar=False,  # the help names the DYN_* variable
        help="Dynamo namespace to register in (or DYN_NAMESPACE).",
    ),
    option(
        "--dynamo-component",
        default=None,
        help="Dynamo component name (default: 'prefill' for a prefill engine, else 'backend').",
    ),
    option("--dynamo-endpoint", default="generate", show_default=True, help="Dynamo endpoint name."),
    option(
        "--dynamo-discovery-backend",
        type=click.Choice(DISCOVERY_BACKENDS),
        default="etcd",
        show_default=True,
        envvar=_envs("--dynamo-discovery-backend", "DYN_DISCOVERY_BACKEND"),
        show_envvar=False,  # the help names the DYN_* variable
        help="Dynamo discovery backend (or DYN_DISCOVERY_BACKEND; 'file' uses DYN_FILE_KV).",
    ),
    option(
        "--dynamo-request-plane",
        type=click.Choice(REQUEST_PLANES),
        default="tcp",
        show_default=True,
        envvar=_envs("--dynamo-request-plane", "DYN_REQUEST_PLANE"),
        show_envvar=False,  # the help names the DYN_* variable
        help="How Dynamo's routers send requests here (or DYN_REQUEST_PLANE).",
    ),
    option(
        "--dynamo-event-plane",
        type=click.Choice(EVENT_PLANES),
        default="zmq",
        show_default=True,
        envvar=_envs("--dynamo-event-plane", "DYN_EVENT_PLANE"),
        show_envvar=False,  # the help names the DYN_* variable
        help="How KV and other Dynamo events are published (or DYN_EVENT_PLANE).",
    ),
    option(
        "--dynamo-model-path",
        type=click.Path(exists=True, file_okay=False),
        default=None,
        help="Model/tokenizer directory to register (default: the engine's tokenizer source).",
    ),
    option(
        "--dynamo-kv-events/--no-dynamo-kv-events",
        default=True,
        show_default=True,
        help="Relay this sidecar's KV events to Dynamo's KV router.",
    ),
    option(
        "--dynamo-parsers/--no-dynamo-parsers",
        default=True,
        show_default=True,
        help="Register the engine's tool-call and reasoning parsers with the model.",
    ),
    option(
        "--dynamo-unregister-grace",
        type=click.FloatRange(min=0),
        default=0.5,
        show_default=True,
        help="On SIGTERM: seconds between leaving Dynamo's discovery and draining.",
    ),
]


def dynamo_options(f: F) -> F:
    """Add the ``--dynamo*`` flags to a click command."""
    for decorator in reversed(_OPTIONS):
        f = decorator(f)
    return f


def dynamo_config(values: Mapping[str, Any]) -> DynamoConfig | None:
    """The :class:`DynamoConfig` from parsed values (``None`` without ``--dynamo``).

    Raises :class:`DynamoConfigError` for unusable values.
    """
    if not values.get("dynamo"):
        return None
    config = DynamoConfig(
        namespace=values["dynamo_namespace"],
        component=values.get("dynamo_component") or None,
        endpoint=values["dynamo_endpoint"],
        discovery_backend=values["dynamo_discovery_backend"],
        request_plane=values["dynamo_request_plane"],
        event_plane=values["dynamo_event_plane"],
        model_path=values.get("dynamo_model_path") or None,
        kv_events=values["dynamo_kv_events"],
        parsers=values["dynamo_parsers"],
        unregister_grace=values["dynamo_unregister_grace"],
    )
    config.validate()
    return config


__all__ = ["DynamoConfigError", "dynamo_config", "dynamo_options"]
