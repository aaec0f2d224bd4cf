"""The Containerfile: small Python base matching the lock, non-root, no GPU libraries, healthcheck
on /health at the CLI's port, entry point openengine-sidecar, installs from the lock + the wheel."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy.helpers import DEPLOY, ROOT, default_ports, port_of, run_default

CONTAINERFILE = DEPLOY / "container" / "Containerfile"
HEALTHCHECK = DEPLOY / "container" / "healthcheck.py"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", CONTAINERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def final_stage() -> list[tuple[str, str]]:
    ins = instructions()
    last_from = max(i for i, (word, _) in enumerate(ins) if word == "FROM")
    return ins[last_from:]


def test_base_image_is_slim_python_of_the_lock() -> None:
    args = dict(a.split("=", 1) for w, a in instructions() if w == "ARG" and "=" in a)
    base = args["PYTHON_IMAGE"]
    assert re.fullmatch(r"docker\.io/library/python:3\.11-slim(-\w+)?", base), base
    lock_python = re.search(r"--python-version (\S+)", (ROOT / "scripts" / "lock").read_text())
    assert lock_python and base.split(":")[1].startswith(lock_python.group(1))
    assert all(a.startswith("${PYTHON_IMAGE}") for w, a in instructions() if w == "FROM")


def test_no_gpu_libraries() -> None:
    text = " ".join(a for _, a in instructions()).lower()
    for word in ("cuda", "nvidia", "cudnn", "nccl", "torch", "tensorrt", "vllm", "sglang"):
        assert word not in text, word


def test_installs_exactly_the_lock_and_the_wheel() -> None:
    runs = " ".join(a for w, a in instructions() if w == "RUN")
    assert "pip install --require-hashes --only-binary=:all: -r /tmp/requirements.lock" in runs
    assert re.search(r"pip install --no-deps \"\$wheel\"", runs)
    copies = [a for w, a in instructions() if w == "COPY"]
    assert "requirements.lock /tmp/requirements.lock" in copies and "dist/ /tmp/dist/" in copies


def test_runs_as_non_root_with_cli_entry_point() -> None:
    final = final_stage()
    (user,) = [a for w, a in final if w == "USER"]
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0
    (entry,) = [a for w, a in final if w == "ENTRYPOINT"]
    assert json.loads(entry) == ["openengine-sidecar"]
    (cmd,) = [a for w, a in final if w == "CMD"]
    assert json.loads(cmd) == ["run"]
    assert ("STOPSIGNAL", "SIGTERM") in final


def test_ports_and_healthcheck_match_the_cli() -> None:
    final = final_stage()
    env = dict(item.split("=", 1) for w, a in final if w == "ENV" for item in shlex.split(a))
    ports = default_ports()
    assert port_of(env["OPENENGINE_SIDECAR_LISTEN"]) == ports["ws"]
    assert port_of(env["OPENENGINE_SIDECAR_HTTP_LISTEN"]) == ports["http"]
    assert port_of(env["OPENENGINE_SIDECAR_KV_PUBLISH"]) == ports["kv-pub"]
    assert port_of(env["OPENENGINE_SIDECAR_KV_REPLAY"]) == ports["kv-replay"]
    (expose,) = [a for w, a in final if w == "EXPOSE"]
    assert sorted(map(int, expose.split())) == sorted(ports.values())
    (health,) = [a for w, a in final if w == "HEALTHCHECK"]
    assert json.loads(health.split("CMD", 1)[1]) == [
        "python3",
        "/usr/local/bin/openengine-sidecar-healthcheck",
    ]
    start = re.search(r"--start-period=(\d+)s", health)
    assert start and int(start.group(1)) >= run_default("startup_deadline")
    assert "deploy/container/healthcheck.py /usr/local/bin/openengine-sidecar-healthcheck" in [
        a for w, a in final if w == "COPY"
    ]


def test_healthcheck_default_is_the_cli_default() -> None:
    text = HEALTHCHECK.read_text()
    assert f'DEFAULT = "{run_default("http_listen")}"' in text


@pytest.mark.parametrize(
    ("listen", "tls", "url"),
    [
        ("0.0.0.0:9001", "", "http://127.0.0.1:9001/health"),
        ("[::]:9001", "", "http://127.0.0.1:9001/health"),
        ("10.1.2.3:8601", "/cert.pem", "https://10.1.2.3:8601/health"),
        ("[fd00::1]:8601", "", "http://[fd00::1]:8601/health"),
    ],
)
def test_healthcheck_url(listen: str, tls: str, url: str) -> None:
    code = "import runpy, sys; print(runpy.run_path(sys.argv[1])['url']())"
    env = {"OPENENGINE_SIDECAR_HTTP_LISTEN": listen, "OPENENGINE_SIDECAR_TLS_CERT": tls}
    out = subprocess.run(
        [sys.executable, "-c", code, str(HEALTHCHECK)], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == url


def test_healthcheck_fails_without_a_server(tmp_path: Path) -> None:
    env = {"OPENENGINE_SIDECAR_HTTP_LISTEN": "127.0.0.1:9"}  # discard port: nothing listens
    result = subprocess.run([sys.executable, str(HEALTHCHECK)], env=env, capture_output=True, timeout=30)
    assert result.returncode == 1
