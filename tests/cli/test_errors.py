"""How the CLI says something went wrong, the same for every subcommand (real processes): one
prefix, ``openengine-sidecar: ``, on every error line, usage error or operational failure; an
unknown subcommand gets the nearest name; no subcommand at all prints the help."""

from __future__ import annotations

import importlib.util
import socket
from pathlib import Path

import pytest

from sidecar.cli import SUBCOMMANDS, suggest
from tests.cli.helpers import cli

PREFIX = "openengine-sidecar: "


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _operational(tmp_path: Path) -> dict[str, tuple[list[str], int, str]]:
    """Per subcommand: an invocation that fails at run time (no usage error), its exit status
    and a piece of its error line. Nothing listens on the port or the socket path."""
    port = _closed_port()
    gone = f"unix://{tmp_path}/none.sock"
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    return {
        "run": (["--engine", gone, "--startup-deadline", "0.2"], 1, "not ready after 0.2s"),
        "describe": (["--engine", gone, "--connect-timeout", "1"], 1, gone),
        "generate": (["--sidecar", f"ws://127.0.0.1:{port}", "hi"], 1, "connection refused"),
        "disagg": (
            ["--prefill", f"ws://127.0.0.1:{port}", "--decode", f"ws://127.0.0.1:{port}", "hi"],
            1,
            "unreachable",
        ),
        "conformance": (["--engine", gone, "--connect-timeout", "1"], 2, gone),
        "mock-engine": (
            ["--listen", f"unix://{tmp_path}/e.sock", "--kv-host", "192.0.2.1"],
            1,
            "cannot bind the KV event publisher",
        ),
        # (with the extra installed it would load the model: skipped there)
        "vllm-engine": (["--model", str(model)], 1, "'vllm' extra is not installed"),
        "sglang-engine": (["--model", str(model)], 1, "'sglang' extra is not installed"),
    }


#: bench has no failure that is quick to provoke; its one (Ctrl-C) goes through the same CommandError.
OPERATIONAL = sorted(set(SUBCOMMANDS) - {"bench"})


@pytest.mark.parametrize("command", OPERATIONAL)
async def test_every_operational_error_line_has_the_prefix(command: str, tmp_path: Path) -> None:
    extra = {"vllm-engine": "vllm", "sglang-engine": "sglang"}.get(command)
    if extra is not None and importlib.util.find_spec(extra) is not None:
        pytest.skip(f"the '{extra}' extra is installed: no quick run-time failure")
    args, code, needle = _operational(tmp_path)[command]
    done = await cli(command, *args, timeout=60)
    assert done.code == code, done.err
    errors = [line for line in done.err_lines if needle in line]
    assert errors, done.err
    assert all(line.startswith(PREFIX) for line in errors), done.err
    assert done.err_lines[-1].startswith(PREFIX), done.err


def test_the_sweep_covers_every_subcommand_but_bench(tmp_path: Path) -> None:
    assert set(_operational(tmp_path)) == set(OPERATIONAL) == set(SUBCOMMANDS) - {"bench"}


@pytest.mark.parametrize("command", sorted(SUBCOMMANDS))
async def test_every_usage_error_line_has_the_prefix(command: str) -> None:
    done = await cli(command, "--no-such-flag")
    assert done.code == 2, done.err
    assert len(done.err_lines) == 1, done.err
    line = done.err_lines[0]
    assert line.startswith(f"{PREFIX}No such option") and "'--no-such-flag'" in line, done.err
    assert line.endswith(f"(see 'python -m sidecar {command} --help')"), done.err


@pytest.mark.parametrize(
    ("typed", "meant"),
    [("rnu", "run"), ("gen", "generate"), ("mock", "mock-engine"), ("conformnce", "conformance")],
)
async def test_a_mistyped_subcommand_gets_a_suggestion(typed: str, meant: str) -> None:
    done = await cli(typed, "--engine", "127.0.0.1:1")
    assert done.code == 2
    assert done.err_lines == [
        f"{PREFIX}No such command {typed!r}. Did you mean {meant!r}? (see 'python -m sidecar --help')"
    ], done.err


def test_suggestions() -> None:
    names = sorted(SUBCOMMANDS)
    assert suggest("descibe", names) == "describe"
    assert suggest("vllm", names) == "vllm-engine"
    assert suggest("d", names) is None  # describe or disagg: no guess
    assert suggest("xyzzy", names) is None


async def test_an_unknown_subcommand_without_a_near_name() -> None:
    done = await cli("xyzzy")
    assert done.code == 2
    assert done.err_lines == [f"{PREFIX}No such command 'xyzzy'. (see 'python -m sidecar --help')"]


async def test_no_subcommand_prints_the_help_as_it_is_formatted() -> None:
    """It was the whole help folded into one error line."""
    done = await cli()
    assert done.code == 2
    assert done.err.startswith("Usage: "), done.err
    assert "\nCommands:\n" in done.err and not done.err.startswith(PREFIX), done.err
