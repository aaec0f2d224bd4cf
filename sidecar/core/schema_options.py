"""The schema-release flags of ``run`` and ``describe`` (docs/COMPATIBILITY.md)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from sidecar.cli_options import command_option, parsed
from sidecar.core.handoff_profiles import parse_profile
from sidecar.core.negotiation import parse_release

__all__ = ["schema_options", "schema_options_for"]

F = TypeVar("F", bound=Callable[..., object])


def schema_options(command: F) -> F:
    """``run``'s schema-release flags (:func:`schema_options_for`)."""
    return schema_options_for("run")(command)


def schema_options_for(name: str) -> Callable[[F], F]:
    """``--expected-schema-release``, ``--require-known-release`` and ``--handoff-profile`` of
    subcommand ``name`` (``run``, ``describe``; docs/COMPATIBILITY.md), validated when parsed,
    each reading that subcommand's variable."""
    option = command_option(name)

    def apply(command: F) -> F:
        # innermost first: --help lists them in the order written above
        command = option(
            "--handoff-profile",
            default=None,
            callback=parsed(parse_profile),
            help="Handoff profile of a prefill/decode engine that advertises none (docs/COMPATIBILITY.md).",
        )(command)
        command = option(
            "--require-known-release",
            is_flag=True,
            default=False,
            help="Refuse an engine whose schema release this build was not tested with (see --version).",
        )(command)
        return option(
            "--expected-schema-release",
            default=None,
            callback=parsed(parse_release),
            help="Refuse an engine that does not report this schema release (source commit, BSR "
            "commit or tag).",
        )(command)

    return apply
