"""The config file, the environment variables and the log formats (issue 21: one meaning per
variable, ``--config`` with flag > env > file > default, ``--log-level``/``--log-format``
before or after the subcommand, ``--log-format json``)."""

from __future__ import annotations

import json
import logging
import re
import signal
from pathlib import Path
from typing import Any

import click
import pytest
import trio

from sidecar.childproc import ENGINE_READY
from sidecar.cli import main
from sidecar.cli_options import ENV_PREFIX
from sidecar.logs import json_formatter, log_context
from tests.cli.helpers import clean_env, cli, one_line_usage_error
from tests.e2e.harness import eventually, mock_engine, sidecar, spawn


def _commands() -> dict[str, click.Command]:
    ctx = click.Context(main)
    out = {}
    for name in main.list_commands(ctx):
        command = main.get_command(ctx, name)
        assert command is not None
        out[name] = command
    return out


def test_every_flag_has_help_and_one_meaning_per_variable() -> None:
    seen: dict[str, tuple[str, str]] = {}
    shared = {"config", "log_level", "log_format"}
    for name, command in _commands().items():
        for param in command.params:
            if not isinstance(param, click.Option) or param.hidden:
                continue
            assert param.help, f"{name} {param.opts[0]} has no help text"
            if param.name == "help":
                continue
            assert param.envvar, f"{name} {param.opts[0]} reads no environment variable"
            names = [param.envvar] if isinstance(param.envvar, str) else list(param.envvar)
            for var in names:
                if not var.startswith(ENV_PREFIX):
                    continue  # e.g. Dynamo's own DYN_NAMESPACE, read by run only
                owner = ("*", param.name) if param.name in shared else (name, param.opts[0])
                assert seen.setdefault(var, owner) == owner, f"{var}: {seen[var]} and {owner}"
    assert seen["OPENENGINE_SIDECAR_CONFORMANCE_JSON"] == ("conformance", "--json")
    assert seen["OPENENGINE_SIDECAR_DESCRIBE_JSON"] == ("describe", "--json")
    assert seen["OPENENGINE_SIDECAR_DISAGG_PREFILL"] == ("disagg", "--prefill")
    assert seen["OPENENGINE_SIDECAR_CONFORMANCE_PREFILL"] == ("conformance", "--prefill")
    assert seen["OPENENGINE_SIDECAR_MOCK_LISTEN"] == ("mock-engine", "--listen")
    assert seen["OPENENGINE_SIDECAR_BENCH_OUT"] == ("bench", "--out")
    assert seen["OPENENGINE_SIDECAR_DRAIN_TIMEOUT"] == ("run", "--drain-timeout")


async def test_conformance_json_variable_is_no_boolean_elsewhere(tmp_path: Path) -> None:
    """``OPENENGINE_SIDECAR_JSON=1`` once wrote a conformance report named ``1``."""
    env = clean_env(OPENENGINE_SIDECAR_JSON="1")
    done = await cli("conformance", "--list", env=env, cwd=tmp_path)
    assert done.code == 0 and not (tmp_path / "1").exists()


def _unreachable(path: Path) -> str:
    return f"engine at unix://{path} is unreachable"


async def test_config_file_precedence_flag_env_file_default(tmp_path: Path) -> None:
    config = tmp_path / "sidecar.toml"
    config.write_text(
        'log-level = "warning"\n\n[describe]\n'
        f'engine = "unix://{tmp_path}/file.sock"\nconnect-timeout = 0.5\n'
    )
    # file only (before the subcommand, and after it)
    for args in (["--config", str(config), "describe"], ["describe", "--config", str(config)]):
        done = await cli(*args)
        assert done.code == 1 and _unreachable(tmp_path / "file.sock") in done.err, done.err
    # the environment beats the file (the file read through its own variable)
    env = clean_env(
        OPENENGINE_SIDECAR_CONFIG=str(config),
        OPENENGINE_SIDECAR_DESCRIBE_ENGINE=f"unix://{tmp_path}/env.sock",
    )
    done = await cli("describe", env=env)
    assert done.code == 1 and _unreachable(tmp_path / "env.sock") in done.err, done.err
    # a flag beats both
    done = await cli("describe", "--engine", f"unix://{tmp_path}/flag.sock", env=env)
    assert done.code == 1 and _unreachable(tmp_path / "flag.sock") in done.err, done.err


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("[describe]\nengine = 'x:1'\nconect-timeout = 1\n", "[describe] has no key 'conect-timeout'"),
        ("[descrbe]\nengine = 'x:1'\n", "[descrbe] is not a subcommand"),
        ("[describe]\nengine = 'x:1'\nconnect-timeout = -1\n", "'--connect-timeout' (from the config file)"),
        ("engine = 'x:1'\n", "unknown top-level key 'engine'"),
        ("[describe\n", "is not valid TOML"),
    ],
)
async def test_config_file_mistakes_are_usage_errors(tmp_path: Path, text: str, needle: str) -> None:
    config = tmp_path / "c.toml"
    config.write_text(text)
    done = await cli("--config", str(config), "describe")
    one_line_usage_error(done, needle)


async def test_missing_config_file() -> None:
    done = await cli("describe", "--config", "/nonexistent/sidecar.toml", "--engine", "x:1")
    one_line_usage_error(done, "--config")


def _records(lines: list[str]) -> list[dict[str, Any]]:
    return [json.loads(line) for line in lines if line.strip()]


@pytest.mark.parametrize("where", ["before", "after", "env"])
async def test_json_logs_before_or_after_the_subcommand(tmp_path: Path, where: str) -> None:
    argv = ["mock-engine", "--listen", f"unix://{tmp_path}/e.sock"]
    env = None
    if where == "before":
        argv = ["--log-format", "json", *argv]
    elif where == "after":
        argv = [*argv, "--log-format", "json"]
    else:
        env = {"OPENENGINE_SIDECAR_LOG_FORMAT": "json"}
    with trio.fail_after(30):
        async with spawn(argv, env=env) as proc:
            await proc.wait_for_line(ENGINE_READY)
            proc.signal(signal.SIGTERM)
            assert await proc.wait() == 0
    records = _records(proc.lines)
    assert records, proc.lines
    for record in records:
        assert {"timestamp", "level", "logger", "message"} <= record.keys(), record
    assert any(ENGINE_READY.search(r["message"]) for r in records)


async def test_log_level_after_the_subcommand_wins_over_the_environment(tmp_path: Path) -> None:
    env = clean_env(OPENENGINE_SIDECAR_LOG_LEVEL="debug")
    done = await cli(
        "describe",
        "--engine",
        f"unix://{tmp_path}/x.sock",
        "--connect-timeout",
        "0.2",
        "--log-level",
        "error",
        env=env,
    )
    assert done.code == 1 and "DEBUG" not in done.err, done.err


def test_json_record_carries_the_stream_ids() -> None:
    record = logging.LogRecord(
        "sidecar.core.lifecycle", logging.WARNING, __file__, 1, 'abort of %s failed: "x"\n', ("r1",), None
    )
    from sidecar.logs import _ContextFilter

    with log_context(request_id="r1", stream=7):
        assert _ContextFilter().filter(record)
    data = json.loads(json_formatter().format(record))
    assert data["level"] == "WARNING" and data["logger"] == "sidecar.core.lifecycle"
    assert (
        data["message"] == 'abort of r1 failed: "x"\n' and data["request_id"] == "r1" and data["stream"] == 7
    )
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+\+00:00", data["timestamp"]), data


async def test_json_logs_of_a_served_stream_carry_its_ids(aio_loop: Any, tmp_path: Path) -> None:
    """End to end: ``run --log-format json`` logs a record while serving a stream (the engine
    breaks the stream rules: a token after the finish) with the stream's ``request_id`` and
    ``stream`` as fields, next to timestamp, level, logger and message."""
    with trio.fail_after(60):
        async with (
            mock_engine(tmp_path, "--fault", "token-after-finish") as engine,
            sidecar(engine.address, "--no-kv-events", "--log-format", "json") as sc,
        ):
            done = await cli("generate", "--sidecar", sc.ws, "--max-tokens", "3", "hi")
            assert done.code == 1, done.err

            def stream_record() -> dict[str, Any] | None:
                for record in _records(sc.proc.lines):
                    if "request_id" in record:
                        return record
                return None

            record = await eventually(stream_record, 10)
    assert {"timestamp", "level", "logger", "message", "request_id", "stream"} <= record.keys(), record
    assert record["level"] == "WARNING" and record["logger"].startswith("sidecar."), record
    assert record["request_id"] in record["message"], record
    assert all(json.loads(line) for line in sc.proc.lines if line.strip())  # every line one object
