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
