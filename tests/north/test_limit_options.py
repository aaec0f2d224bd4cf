"""The limit flags of ``run`` (``sidecar.north.limit_options``): defaults equal to the configs',
every value reaching its config, bad values refused at parse time (exit 2, one line)."""

from __future__ import annotations

from typing import Any

import pytest
from click.testing import CliRunner

from sidecar.core.lifecycle import LifecycleConfig
from sidecar.core.sidecar import SidecarConfig
from sidecar.north.http_server import HttpLimits
from sidecar.north.limit_options import apply_limit_options, http_limits
from sidecar.north.ws_server import WsConfig
from sidecar.openengine.message_limits import EngineLimits
from sidecar.run_command import run


def parsed(*argv: str) -> dict[str, Any]:
    ctx = run.make_context("run", ["--engine", "unix:///nowhere", *argv])
    return dict(ctx.params)


def configs(*argv: str) -> tuple[WsConfig, SidecarConfig]:
    ws, config = WsConfig(), SidecarConfig(lifecycle=LifecycleConfig(max_streams=1000))
    apply_limit_options(parsed(*argv), ws, config)
    return ws, config


def test_defaults_are_the_configs_defaults() -> None:
    ws, config = configs()
    assert (ws.max_connections, ws.max_connections_per_peer, ws.max_calls_per_connection) == (4096, 512, 64)
    assert ws.max_pending_bytes == WsConfig().max_pending_bytes and ws.handshake_timeout == 10.0
    assert ws.max_streams_per_peer == 500  # half of --max-streams
    assert (config.client_engine_calls, config.client_engine_calls_per_connection) == (8, 4)
    assert config.lifecycle.max_request_id_length == 256 and config.lifecycle.max_streams == 1000
    assert config.engine_limits == EngineLimits()
    assert (config.engine_limits.max_event_bytes, config.engine_limits.max_answer_bytes) == (4 << 20, 4 << 20)


def test_values_reach_their_configs() -> None:
    ws, config = configs(
        "--max-connections=10",
        "--max-connections-per-peer=0",
        "--peer-stream-share=1",
        "--max-calls-per-connection=3",
        "--max-pending-bytes=4096",
        "--handshake-timeout=2.5",
        "--client-engine-calls=1",
        "--client-engine-calls-per-connection=1",
        "--max-request-id-length=40",
        "--engine-max-event-bytes=65536",
        "--engine-max-answer-bytes=1048576",
    )
    assert (ws.max_connections, ws.max_connections_per_peer, ws.max_streams_per_peer) == (10, 0, 0)
    assert (ws.max_calls_per_connection, ws.max_pending_bytes, ws.handshake_timeout) == (3, 4096, 2.5)
    assert (config.client_engine_calls, config.client_engine_calls_per_connection) == (1, 1)
    assert config.lifecycle.max_request_id_length == 40
    assert (config.engine_limits.max_event_bytes, config.engine_limits.max_answer_bytes) == (65536, 1 << 20)


def test_http_limits_reach_their_config() -> None:
    assert http_limits(parsed()) == HttpLimits()
    assert (HttpLimits().max_connections, HttpLimits().max_connections_per_peer) == (128, 16)
    limits = http_limits(
        parsed(
            "--http-max-connections=0",
            "--http-max-connections-per-peer=3",
            "--http-idle-timeout=2",
            "--http-max-header-bytes=4096",
        )
    )
    assert (limits.max_connections, limits.max_connections_per_peer) == (0, 3)
    assert (limits.idle_timeout, limits.max_header_bytes) == (2.0, 4096)


def test_environment_variables_are_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENENGINE_SIDECAR_MAX_CONNECTIONS_PER_PEER", "7")
    monkeypatch.setenv("OPENENGINE_SIDECAR_HTTP_MAX_CONNECTIONS_PER_PEER", "5")
    ws, _ = configs()
    assert ws.max_connections_per_peer == 7
    assert http_limits(parsed()).max_connections_per_peer == 5


@pytest.mark.parametrize(
    "flag",
    [
        "--max-connections=-1",
        "--peer-stream-share=0",
        "--peer-stream-share=1.5",
        "--max-calls-per-connection=0",
        "--max-pending-bytes=10",
        "--handshake-timeout=0",
        "--max-request-id-length=0",
        "--client-engine-calls=x",
        "--engine-max-event-bytes=1024",
        "--engine-max-answer-bytes=4MiB",
        "--http-max-connections=-1",
        "--http-max-connections-per-peer=x",
    ],
)
def test_bad_values_are_refused_at_parse_time(flag: str) -> None:
    result = CliRunner().invoke(run, ["--engine", "unix:///nowhere", flag])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and flag.split("=")[0] in result.output
