"""systemd's notify protocol (``sd_notify``): one datagram to ``$NOTIFY_SOCKET``.

``READY=1`` once the sidecar serves, ``STOPPING=1`` when it starts draining, ``STATUS=…``
for ``systemctl status``, ``WATCHDOG=1`` for an optional watchdog. Without
``NOTIFY_SOCKET`` (not under systemd ``Type=notify``) every call is a no-op.
"""

from __future__ import annotations

import os
import socket


def notify(*states: str) -> bool:
    """Send ``states`` (e.g. ``"READY=1"``, ``"STATUS=serving"``) as one message.

    Returns True when a message was sent; False without ``NOTIFY_SOCKET``. Never raises:
    a supervisor that cannot be told must not take the sidecar down.
    """
    address = os.environ.get("NOTIFY_SOCKET")
    if not address or not states:
        return False
    if address.startswith("@"):  # abstract namespace
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall("\n".join(states).encode())
        return True
    except OSError:
        return False


def watchdog_interval() -> float | None:
    """Half of systemd's ``WATCHDOG_USEC`` in seconds (when the watchdog targets this process)."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return int(usec) / 2_000_000
    except ValueError:
        return None
