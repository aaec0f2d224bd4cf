"""Runtime hang switches of a simulated engine: the quiet faults that are not crashes.

A real engine can hang without dying — a stuck collective, a GIL-bound loop — while its
sockets stay open. Two switches, flipped while the engine runs (the ``mock-engine`` command
maps them to signals, like SIGSTOP/SIGCONT for a whole-process hang):

- **control** (``SIGUSR1`` toggles): every Control call (Health, GetLoad, Abort, discovery,
  LoRA, Drain, KV-event subscriptions) waits until the switch is off again; Generate streams
  run as usual. The HTTP/2 layer still answers (PINGs are acknowledged).
- **generate** (``SIGUSR2`` toggles): every Generate stream stops advancing (no token, no
  terminal) until the switch is off; new requests are accepted and wait; an Abort still ends a
  request (the Control service works); Health answers READY.

Resources: two ``asyncio.Event`` objects (set = running). No task of its own.
"""

from __future__ import annotations

import asyncio
import logging
import signal

log = logging.getLogger(__name__)

CONTROL_SIGNAL = signal.SIGUSR1
GENERATE_SIGNAL = signal.SIGUSR2


class Hangs:
    """The two switches (see the module doc); both off at start."""

    def __init__(self) -> None:
        self.control_running = asyncio.Event()
        self.control_running.set()
        self.generate_running = asyncio.Event()
        self.generate_running.set()

    @staticmethod
    def _toggle(event: asyncio.Event, what: str) -> None:
        if event.is_set():
            event.clear()
            log.warning("hang switch: %s hung", what)
        else:
            event.set()
            log.warning("hang switch: %s running again", what)

    def toggle_control(self) -> None:
        self._toggle(self.control_running, "the Control service")

    def toggle_generate(self) -> None:
        self._toggle(self.generate_running, "Generate")

    async def control(self) -> None:
        """Wait while the Control service is hung (call at the start of every Control RPC)."""
        if not self.control_running.is_set():
            await self.control_running.wait()

    def install_signals(self, loop: asyncio.AbstractEventLoop) -> None:
        """``SIGUSR1`` toggles the Control hang, ``SIGUSR2`` the Generate hang."""
        loop.add_signal_handler(CONTROL_SIGNAL, self.toggle_control)
        loop.add_signal_handler(GENERATE_SIGNAL, self.toggle_generate)
