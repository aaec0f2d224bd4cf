"""The schema-release flags of ``run`` and ``describe`` (docs/COMPATIBILITY.md)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sidecar.cli_options import option, parsed
from sidecar.core.handoff_profiles import parse_profile
from sidecar.core.negotiation import parse_release

__all__ = ["schema_options"]


def schema_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """``--expected-schema-release``, ``--require-known-release`` and ``--handoff-profile``
    (``run`` and ``describe``; docs/COMPATIBILITY.md), validated when parsed."""
    for decorator in reversed(
        [
            option(
                "--expected-schema-release",
                default=None,
                callback=parsed(parse_release),
                help="Refuse an engine that does not report this schema release (source commit, BSR "
                "commit or tag).",
            ),
            option(
                "--require-known-release",
                is_flag=True,
                default=False,
                help="Refuse an engine whose schema release this build was not tested with (see --version).",
            ),
            option(
                "--handoff-profile",
                default=None,
                callback=parsed(parse_profile),
                help="Handoff profile of a prefill/decode engine that advertises none (docs/COMPATIBILITY.md).",
            ),
        ]
    ):
        command = decorator(command)
    return command
