"""systemd units and example env files: structure, timeouts against the CLI, `systemd-analyze`."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.deploy.helpers import (
    DEPLOY,
    default_ports,
    port_of,
    run_default,
    run_env_vars,
    stop_budget,
)
from tests.prereq import require_tool

SYSTEMD = DEPLOY / "systemd"
TEMPLATE = SYSTEMD / "openengine-sidecar@.service"
PLAIN = SYSTEMD / "openengine-sidecar.service"
UNITS = [TEMPLATE, PLAIN]
ENV_FILES = sorted((SYSTEMD / "env").glob("*.env"))
EXEC = "/opt/openengine-sidecar/bin/openengine-sidecar"


def parse_unit(path: Path) -> dict[str, dict[str, list[str]]]:
    """Sections → key → values (systemd allows repeated keys, so configparser does not fit)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        assert current is not None, f"{path.name}: key outside a section: {line}"
        key, sep, value = line.partition("=")
        assert sep, f"{path.name}: not a key=value line: {line}"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def one(unit: dict[str, dict[str, list[str]]], section: str, key: str) -> str:
    values = unit[section].get(key)
    assert values and len(values) == 1, f"[{section}] {key}: {values}"
    return values[0]


def seconds(value: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(s|sec|min|m)?", value)
    assert m, f"unsupported time span {value!r}"
    return float(m.group(1)) * (60 if m.group(2) in ("min", "m") else 1)


def env_file(path: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            key, _, value = line.partition("=")
            out[key] = value
    return out


@pytest.mark.parametrize("path", UNITS, ids=lambda p: p.name)
def test_unit_lifecycle(path: Path) -> None:
    unit = parse_unit(path)
    service = unit["Service"]
    assert one(unit, "Service", "Type") == "notify"
    assert one(unit, "Service", "NotifyAccess") == "main"
    assert one(unit, "Service", "KillSignal") == "SIGTERM"
    assert one(unit, "Service", "Restart") == "on-failure"
    assert one(unit, "Service", "ExecStart") == f"{EXEC} run"
    assert seconds(one(unit, "Service", "TimeoutStopSec")) > stop_budget()
    assert seconds(one(unit, "Service", "TimeoutStartSec")) > run_default("startup_deadline")
    watchdog = seconds(one(unit, "Service", "WatchdogSec"))
    assert watchdog >= 10, "the sidecar pets every WatchdogSec/2; keep room for slow steps"
    assert "multi-user.target" in unit["Install"]["WantedBy"]
    assert service["EnvironmentFile"] == [
        "/etc/openengine-sidecar/%i.env"
        if "@" in path.name
        else "/etc/openengine-sidecar/openengine-sidecar.env"
    ]


@pytest.mark.parametrize("path", UNITS, ids=lambda p: p.name)
def test_unit_hardening(path: Path) -> None:
    unit = parse_unit(path)
    service = unit["Service"]
    assert service.get("DynamicUser") == ["yes"] or service.get("User"), "dedicated or dynamic user"
    for key, value in {
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "PrivateTmp": "yes",
        "ProtectHome": "yes",
        "PrivateDevices": "yes",
        "RestrictNamespaces": "yes",
        "CapabilityBoundingSet": "",
    }.items():
        assert one(unit, "Service", key) == value, key
    families = one(unit, "Service", "RestrictAddressFamilies").split()
    assert sorted(families) == ["AF_INET", "AF_INET6", "AF_UNIX"]


def test_template_and_plain_unit_agree() -> None:
    """The two units differ only in naming (instance paths), never in lifecycle or hardening."""
    template, plain = parse_unit(TEMPLATE)["Service"], parse_unit(PLAIN)["Service"]
    differing = {k for k in template.keys() | plain.keys() if template.get(k) != plain.get(k)}
    assert differing == {"EnvironmentFile", "RuntimeDirectory"}


@pytest.mark.parametrize("path", ENV_FILES, ids=lambda p: p.name)
def test_env_file_names_real_flags(path: Path) -> None:
    """Every variable (also the commented-out examples) is one the CLI reads."""
    known = run_env_vars()
    named = re.findall(r"^#?(OPENENGINE_SIDECAR_[A-Z0-9_]+)=", path.read_text(), flags=re.M)
    assert named, path
    assert not set(named) - known, f"{path.name}: unknown variables {set(named) - known}"
    env = env_file(path)
    assert env["OPENENGINE_SIDECAR_ENGINE"].startswith("unix:///run/openengine/")
    assert float(env.get("OPENENGINE_SIDECAR_DRAIN_TIMEOUT", run_default("drain_timeout"))) + 3 < seconds(
        one(parse_unit(TEMPLATE), "Service", "TimeoutStopSec")
    )


def env_ports(path: Path) -> dict[str, int]:
    env = env_file(path)
    return {
        "ws": port_of(env["OPENENGINE_SIDECAR_LISTEN"]),
        "http": port_of(env["OPENENGINE_SIDECAR_HTTP_LISTEN"]),
        "kv-pub": port_of(env["OPENENGINE_SIDECAR_KV_PUBLISH"]),
        "kv-replay": port_of(env["OPENENGINE_SIDECAR_KV_REPLAY"]),
    }


def test_env_file_ports() -> None:
    """The aggregated and prefill examples use the CLI's default ports; decode can run beside prefill."""
    assert env_ports(SYSTEMD / "env" / "agg.env") == default_ports()
    assert env_ports(SYSTEMD / "env" / "prefill.env") == default_ports()
    prefill, decode = env_ports(SYSTEMD / "env" / "prefill.env"), env_ports(SYSTEMD / "env" / "decode.env")
    assert not set(prefill.values()) & set(decode.values())


def verify_copy(tmp_path: Path, unit: Path, name: str) -> Path:
    """A copy of ``unit`` named ``name`` whose ExecStart points at an executable that exists here."""
    stub = tmp_path / "openengine-sidecar"
    stub.write_text("#!/bin/sh\nexit 0\n")
    stub.chmod(0o755)
    text = unit.read_text()
    assert text.count(EXEC) == 1
    copy = tmp_path / name
    copy.write_text(text.replace(EXEC, str(stub)))
    if "@" in name:  # systemd-analyze resolves foo@bar.service from foo@.service beside it
        (tmp_path / unit.name).write_text(copy.read_text())
    return copy


@pytest.mark.parametrize(
    ("unit", "name"), [(TEMPLATE, "openengine-sidecar@vllm.service"), (PLAIN, PLAIN.name)]
)
def test_systemd_analyze_verify(tmp_path: Path, unit: Path, name: str) -> None:
    tool = require_tool("systemd-analyze")
    copy = verify_copy(tmp_path, unit, name)
    result = subprocess.run(
        [tool, "verify", "--man=no", str(copy)], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    ours = [line for line in (result.stdout + result.stderr).splitlines() if "openengine-sidecar" in line]
    assert result.returncode == 0 and not ours, result.stdout + result.stderr


@pytest.mark.parametrize(
    ("unit", "name"), [(TEMPLATE, "openengine-sidecar@vllm.service"), (PLAIN, PLAIN.name)]
)
def test_systemd_analyze_security(tmp_path: Path, unit: Path, name: str) -> None:
    """systemd's own exposure score stays in its "OK" band (below 3.0 of 10)."""
    tool = require_tool("systemd-analyze")
    copy = verify_copy(tmp_path, unit, name)
    result = subprocess.run(
        [tool, "security", "--offline=yes", "--threshold=30", "--no-pager", str(copy)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr


def test_example_config_file_keys_are_flags() -> None:
    """deploy/config/sidecar.toml (shown by the units, the env files and the Containerfile)."""
    import tomllib

    from sidecar.cli_common import default_map
    from sidecar.run_command import run

    path = DEPLOY / "config" / "sidecar.toml"
    with open(path, "rb") as f:
        data = tomllib.load(f)
    values = default_map(data, run, "run", str(path))
    assert values["engine"].startswith("unix:///") and values["log_format"] == "json"
    for unit in UNITS:
        assert "OPENENGINE_SIDECAR_CONFIG" in unit.read_text(), unit.name
    assert "deploy/config/sidecar.toml" in (DEPLOY / "container" / "Containerfile").read_text()
