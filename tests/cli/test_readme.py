"""The README's commands as written (issue 21: "every command it shows works as written on a
fresh clone"): its "Running it" block — a simulated engine on ``/tmp/engine.sock``, the sidecar
on its default ports 8600/8601, a client, the HTTP endpoints — and then its documented
conformance step against that engine, each a real process that must exit 0 without a traceback.

The commands are read from README.md, so the test follows the document. They run in network
and mount namespaces of their own (as root: ``unshare``; a private ``/tmp``, a loopback of
their own), so the fixed socket path and ports are theirs alone.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio

from sidecar.childproc import ENGINE_READY, SIDECAR_READY
from tests.cli.helpers import ROOT, clean_env
from tests.e2e.harness import spawn_argv
from tests.prereq import require, require_tool

pytestmark = [pytest.mark.subprocess, pytest.mark.netns]

README = ROOT / "README.md"


def _block_after(heading: str, contains: str) -> list[str]:
    """The ``sh`` block under ``heading`` holding ``contains``: its command lines."""
    text = README.read_text()
    section = text[text.index(heading) :]
    for block in re.findall(r"```sh\n(.*?)```", section, re.S):
        if contains in block:
            lines = [line.split("  #")[0].strip() for line in block.splitlines()]
            return [line for line in lines if line and not line.startswith("#")]
    raise AssertionError(f"README: no sh block with {contains!r} under {heading!r}")


def _private_tmp(root: Path) -> str:
    """Shell that mounts a private tmpfs on ``/tmp``, keeping ``root`` visible at its path when
    it lives under ``/tmp`` (a checkout cloned there, as CI may: the tmpfs would hide it). The
    old ``/tmp`` is reached through a temporary bind under ``/run``, unmounted and removed at once."""
    if not root.is_relative_to("/tmp"):
        return "mount -t tmpfs tmpfs /tmp"
    rel = shlex.quote(str(root.relative_to("/tmp")))
    return (
        "k=$(mktemp -d /run/openengine-readme-XXXXXX) && mount --bind /tmp $k && "
        f"mount -t tmpfs tmpfs /tmp && mkdir -p /tmp/{rel} && mount --bind $k/{rel} /tmp/{rel} && "
        "umount $k && rmdir $k"
    )


@asynccontextmanager
async def _namespaces() -> AsyncIterator[list[str]]:
    """A process holding new network and mount namespaces (loopback up, ``/tmp`` a private
    tmpfs); yields the ``nsenter`` prefix that runs a command in them."""
    require(os.geteuid() == 0, "needs root (unshare of network and mount namespaces)")
    unshare, nsenter, _ip = require_tool("unshare"), require_tool("nsenter"), require_tool("ip")
    setup = f"ip link set lo up && {_private_tmp(ROOT)} && echo ready && exec sleep infinity"
    argv = [
        unshare,
        "--net",
        "--mount",
        "--propagation",
        "private",
        "--fork",
        "--kill-child",
        "sh",
        "-c",
        setup,
    ]
    holder = await trio.lowlevel.open_process(argv, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
    try:
        assert holder.stdout is not None
        with trio.fail_after(20):
            assert (await holder.stdout.receive_some(64)).strip() == b"ready"
        # entering a mount namespace moves to its root: --wd keeps the README's relative paths
        yield [nsenter, "-t", str(holder.pid), "-n", "-m", f"--wd={ROOT}", "--"]
    finally:
        holder.kill()  # the namespaces go with their last process
        with trio.CancelScope(shield=True), trio.move_on_after(5):
            await holder.wait()


async def _run(prefix: list[str], line: str, timeout: float) -> str:
    with trio.fail_after(timeout):
        done = await trio.run_process(
            [*prefix, "sh", "-c", line],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
            cwd=ROOT,
            env=clean_env(),
        )
    out, err = done.stdout.decode(errors="replace"), done.stderr.decode(errors="replace")
    assert done.returncode == 0, (line, done.returncode, out[-2000:], err[-2000:])
    assert "Traceback" not in out + err, (line, err)
    return out


async def test_readme_running_it_and_conformance_as_written() -> None:
    running = _block_after("## Running it", "mock-engine")
    engine_cmd = next(line for line in running if " mock-engine " in line)
    run_cmd = next(line for line in running if " run " in line)
    rest = [line for line in running if line not in (engine_cmd, run_cmd)]
    conformance = _block_after("## Running it", "conformance --engine")
    assert engine_cmd.endswith("&") and "unix:///tmp/engine.sock" in engine_cmd, engine_cmd
    assert [line for line in conformance if "conformance" in line], conformance
    async with _namespaces() as prefix:
        env = clean_env()
        with trio.fail_after(240):
            async with spawn_argv(
                [*prefix, *shlex.split(engine_cmd.rstrip("& "))], env, label="engine"
            ) as eng:
                await eng.wait_for_line(ENGINE_READY, timeout=60)
                async with spawn_argv([*prefix, *shlex.split(run_cmd)], env, label="sidecar") as sidecar:
                    await sidecar.wait_for_line(SIDECAR_READY, timeout=60)
                    outputs = {line: await _run(prefix, line, 60) for line in rest}
                    for line in conformance:
                        outputs[line] = await _run(prefix, line, 200)
    generate = next(out for line, out in outputs.items() if " generate " in line)
    assert generate.strip(), "generate printed nothing"
    worker = next(out for line, out in outputs.items() if "/v1/worker" in line)
    assert '"servedModelNames"' in worker, worker[:500]
    metrics = next(out for line, out in outputs.items() if "/metrics" in line)
    assert "openengine_sidecar" in metrics or "# TYPE" in metrics, metrics[:500]
