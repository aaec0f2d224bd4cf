"""The --kv-* flags -> KvBridgeConfig."""

from __future__ import annotations

from typing import Any

import click
import pytest
from click.testing import CliRunner

from sidecar.kvbridge import KvConfigError
from sidecar.kvbridge.options import kv_bridge_config, kv_bridge_options


def parse(args: list[str], env: dict[str, str] | None = None, **overrides: Any) -> Any:
    seen: dict[str, Any] = {}

    @click.command()
    @kv_bridge_options
    def cmd(**kw: Any) -> None:
        seen["config"] = kv_bridge_config(kw, **overrides)

    result = CliRunner().invoke(cmd, args, env=env or {}, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return seen["config"]


def test_defaults() -> None:
    c = parse([])
    assert c.publish_endpoint == "tcp://127.0.0.1:5600" and c.replay_endpoint == "tcp://127.0.0.1:5700"
    assert (c.buffer_steps, c.topic, c.hwm, c.advertise_host) == (10_000, "", 100_000, None)


def test_flags_env_and_overrides() -> None:
    c = parse(
        [
            "--kv-publish",
            "tcp://*:6000",
            "--kv-replay",
            "none",
            "--kv-topic",
            "kv",
            "--kv-advertise-host",
            "10.0.0.9",
        ],
        env={"OPENENGINE_SIDECAR_KV_BUFFER_STEPS": "5"},
        dp_ranks=(0, 1),
    )
    assert c.publish_endpoint == "tcp://*:6000" and c.replay_endpoint is None
    assert (c.buffer_steps, c.topic, c.advertise_host, c.dp_ranks) == (5, "kv", "10.0.0.9", (0, 1))
    assert parse(["--no-kv-events"]) is None


def test_bad_endpoint_is_a_config_error() -> None:
    with pytest.raises(KvConfigError):
        parse(["--kv-publish", "udp://x:1"])


def test_replay_and_ingest_limits_reach_the_config() -> None:
    from sidecar.kvbridge import IngestLimits, ReplayLimits

    c = parse([])
    assert c.replay_limits == ReplayLimits() and c.ingest_limits == IngestLimits()
    c = parse(
        [
            "--kv-replay-hwm=7",
            "--kv-replay-socket-buffer=8192",
            "--kv-replay-max-active=3",
            "--kv-replay-stall-timeout=1.5",
            "--kv-max-batch-bytes=4096",
            "--kv-engine-replay-max-batches=9",
            "--kv-engine-replay-max-bytes=2048",
        ],
        env={"OPENENGINE_SIDECAR_KV_ENGINE_REPLAY_DEADLINE": "4"},
    )
    assert (c.replay_limits.hwm, c.replay_limits.socket_buffer, c.replay_limits.max_active) == (7, 8192, 3)
    assert c.replay_limits.stall_timeout == 1.5
    i = c.ingest_limits
    assert (i.max_batch_bytes, i.replay_max_batches, i.replay_max_bytes, i.replay_deadline) == (
        4096,
        9,
        2048,
        4.0,
    )


@pytest.mark.parametrize(
    "flag",
    [
        "--kv-replay-hwm=0",
        "--kv-replay-socket-buffer=100",
        "--kv-replay-max-active=0",
        "--kv-replay-stall-timeout=0",
        "--kv-max-batch-bytes=10",
        "--kv-engine-replay-max-batches=0",
        "--kv-engine-replay-max-bytes=1",
        "--kv-engine-replay-deadline=0",
        "--http-idle-timeout=0",
        "--http-max-header-bytes=10",
    ],
)
def test_bad_limits_are_refused_at_parse_time(flag: str) -> None:
    from sidecar.run_command import run

    result = CliRunner().invoke(run, ["--engine", "unix:///nowhere", flag])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and flag.split("=")[0] in result.output
