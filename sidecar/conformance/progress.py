"""Live progress of a run: an updating status line on a terminal, plain lines otherwise."""

from __future__ import annotations

from typing import TextIO

from sidecar.conformance.model import Check, CheckResult, Status

__all__ = ["LineProgress"]

_MARK = {Status.PASS: "pass", Status.FAIL: "FAIL", Status.SKIP: "skip"}
_CLEAR = "\r\x1b[2K"


class LineProgress:
    """Writes one line per finished check to ``out``.

    On a terminal (``tty``) the running check is shown on a status line that the result
    line then replaces; elsewhere (CI logs, pipes) only the result lines are written.
    """

    def __init__(self, out: TextIO, *, tty: bool | None = None) -> None:
        self.out = out
        self.tty = out.isatty() if tty is None else tty

    def started(self, index: int, total: int, check: Check) -> None:
        if self.tty:
            self.out.write(f"{_CLEAR}[{index + 1:>{len(str(total))}}/{total}] {check.id} …")
            self.out.flush()

    def finished(self, index: int, total: int, result: CheckResult) -> None:
        prefix = _CLEAR if self.tty else ""
        reason = f": {result.reason}" if result.reason and result.status != Status.PASS else ""
        line = (
            f"{prefix}[{index + 1:>{len(str(total))}}/{total}] {_MARK[result.status]}  {result.check.id}"
            f" ({result.duration * 1000:.0f} ms){reason}"
        )
        self.out.write(line + "\n")
        self.out.flush()
