"""The machine a benchmark ran on: cores, CPU model, load, Python, package versions, checkout."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

PACKAGES = (
    "openengine-sidecar",
    "trio",
    "trio-asyncio",
    "trio-websocket",
    "wsproto",
    "grpclib",
    "h2",
    "betterproto2",
    "msgspec",
    "pyzmq",
    "grpcio",
    "grpcio-tools",
    "protobuf",
)
ROOT = Path(__file__).resolve().parents[2]


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def mem_total_mib() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024
    except OSError:
        pass
    return None


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def checkout() -> dict[str, Any]:
    """The git commit of the checkout and whether the tree has changes (read-only git calls)."""

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": git("rev-parse", "HEAD"), "modified_files": len(status.splitlines()) if status else 0}


def describe() -> dict[str, Any]:
    return {
        "cores": os.cpu_count(),
        "cpu_model": cpu_model(),
        "memory_mib": mem_total_mib(),
        "kernel": platform.release(),
        "python": sys.version.split()[0],
        "python_implementation": platform.python_implementation(),
        "packages": versions(),
        "loadavg_start": os.getloadavg(),
        "checkout": checkout(),
    }
