"""Network partitions for end-to-end tests: an engine in its own network namespace.

Two namespaces made for the test — ``engine`` and ``sidecar`` — joined by one veth pair with
``10.231.0.1/30`` (engine side) and ``10.231.0.2/30`` (sidecar side), addresses that exist only
inside those two namespaces. Processes start in a namespace with ``ip netns exec``; the test
process itself enters the sidecar's namespace (:meth:`NetnsPair.entered`: ``setns`` of its own
thread) to reach the sidecar's loopback listeners and, through the veth, the engine.

A partition is a black hole, not a reset: ``iptables -j DROP`` in the engine's namespace, in
both directions (TCP keeps retransmitting, nothing answers, nothing is refused). Everything
is removed when the context ends (deleting a namespace deletes its veth end and its rules).

Needs root, ``ip`` (iproute2) and ``iptables`` (scripts/ci-deps installs them): skipped with
the reason locally, a failure under ``CI=true`` (tests.prereq).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass

from tests.prereq import require, require_tool

ENGINE_IP, SIDECAR_IP = "10.231.0.1", "10.231.0.2"
_CLONE_NEWNET = 0x40000000


def _run(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=20)


def require_netns() -> None:
    """Skip (fail under CI) unless network namespaces can be made here."""
    ip, iptables = require_tool("ip"), require_tool("iptables")
    require(os.geteuid() == 0, "network namespaces need root (CI runs as root)")
    probe = f"oe-probe-{secrets.token_hex(3)}"
    problem = None
    try:
        _run(ip, "netns", "add", probe)
        _run(ip, "netns", "exec", probe, iptables, "-S")
    except (subprocess.CalledProcessError, OSError) as err:
        problem = f"cannot create a network namespace with iptables here: {err}"
    finally:
        subprocess.run([ip, "netns", "delete", probe], capture_output=True, timeout=20)
    require(problem is None, str(problem))


def _setns(path: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({path}): {os.strerror(err)}")
    finally:
        os.close(fd)


@dataclass
class NetnsPair:
    engine: str
    sidecar: str
    veth_engine: str
    veth_sidecar: str
    engine_ip: str = ENGINE_IP
    sidecar_ip: str = SIDECAR_IP
    partitioned: tuple[int, ...] | None = None

    def argv(self, namespace: str, argv: list[str]) -> list[str]:
        """``argv`` run inside ``namespace``."""
        return ["ip", "netns", "exec", namespace, *argv]

    @contextlib.contextmanager
    def entered(self, namespace: str) -> Iterator[None]:
        """This thread's sockets are made in ``namespace`` while inside (back on exit)."""
        home = f"/proc/self/task/{threading.get_native_id()}/ns/net"
        saved = os.open(home, os.O_RDONLY)
        try:
            _setns(f"/var/run/netns/{namespace}")
            try:
                yield
            finally:
                libc = ctypes.CDLL(None, use_errno=True)
                if libc.setns(saved, _CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), "setns back to the original namespace")
        finally:
            os.close(saved)

    def _rules(self, ports: tuple[int, ...], action: str) -> None:
        iptables = ["ip", "netns", "exec", self.engine, "iptables"]
        if not ports:
            _run(*iptables, action, "INPUT", "-i", self.veth_engine, "-j", "DROP")
            _run(*iptables, action, "OUTPUT", "-o", self.veth_engine, "-j", "DROP")
            return
        for port in ports:
            _run(
                *iptables,
                action,
                "INPUT",
                "-i",
                self.veth_engine,
                "-p",
                "tcp",
                "--dport",
                str(port),
                "-j",
                "DROP",
            )
            _run(
                *iptables,
                action,
                "OUTPUT",
                "-o",
                self.veth_engine,
                "-p",
                "tcp",
                "--sport",
                str(port),
                "-j",
                "DROP",
            )

    def partition(self, *ports: int) -> None:
        """Black-hole the engine's traffic (only these TCP ports of the engine, if given)."""
        if self.partitioned is not None:
            raise RuntimeError("already partitioned")
        self._rules(ports, "-A")
        self.partitioned = ports

    def heal(self) -> None:
        if self.partitioned is not None:
            self._rules(self.partitioned, "-D")
            self.partitioned = None


@contextlib.contextmanager
def netns_pair() -> Iterator[NetnsPair]:
    """Two fresh namespaces joined by a veth pair (module doc); removed on exit, always."""
    require_netns()
    tag = secrets.token_hex(3)
    pair = NetnsPair(f"oe-eng-{tag}", f"oe-sc-{tag}", f"oee{tag}", f"oes{tag}")
    made: list[str] = []
    try:
        for ns in (pair.engine, pair.sidecar):
            _run("ip", "netns", "add", ns)
            made.append(ns)
        _run("ip", "link", "add", pair.veth_engine, "type", "veth", "peer", "name", pair.veth_sidecar)
        _run("ip", "link", "set", pair.veth_engine, "netns", pair.engine)
        _run("ip", "link", "set", pair.veth_sidecar, "netns", pair.sidecar)
        for ns, dev, ip in (
            (pair.engine, pair.veth_engine, pair.engine_ip),
            (pair.sidecar, pair.veth_sidecar, pair.sidecar_ip),
        ):
            _run("ip", "-n", ns, "addr", "add", f"{ip}/30", "dev", dev)
            _run("ip", "-n", ns, "link", "set", dev, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
        yield pair
    finally:
        subprocess.run(["ip", "link", "delete", pair.veth_engine], capture_output=True, timeout=20)
        for ns in made:
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True, timeout=20)
