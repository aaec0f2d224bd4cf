"""A CPU-time sampling profiler for one process: ``python -m sidecar.bench.cpuprof OUT [HZ] -- ARGS...``.

Runs the sidecar's CLI with ``ARGS`` (``openengine-sidecar ARGS``) while ``SIGPROF`` fires
every ``1/HZ`` seconds of the process's **CPU time** (``setitimer(ITIMER_PROF)``); each
signal records the main thread's Python stack. At exit the counts are written to ``OUT`` as
collapsed stacks (``frame;frame;... count``, the format of ``py-spy --format raw`` that
:func:`sidecar.bench.profile.summarize` reads).

Why not only py-spy: py-spy samples wall-clock time of threads that are not sleeping, so on
a loaded machine a thread that is runnable but waiting for a core — typically right after
a ``send()`` that woke the reader — is counted where it waits. CPU-time samples count only
what the process really spent. The Python handler runs between bytecodes, so time inside a
C call is charged to the frame that made it. Other threads' CPU time is charged to the main
thread's stack too: use it on processes whose work is on the main thread (the sidecar
without ``--dynamo``). Overhead: one stack walk per sample (~1 % at 200 Hz).
"""

from __future__ import annotations

import atexit
import signal
import sys
from collections import Counter
from types import FrameType

_counts: Counter[str] = Counter()


def _stack(frame: FrameType | None) -> str:
    parts = []
    while frame is not None:
        code = frame.f_code
        parts.append(f"{code.co_name} ({code.co_filename}:{frame.f_lineno})")
        frame = frame.f_back
    return ";".join(reversed(parts))


def _sample(signum: int, frame: FrameType | None) -> None:
    _counts[_stack(frame)] += 1


def start(out: str, hz: int = 200) -> None:
    """Start sampling; the profile is written to ``out`` when the process exits."""

    def dump() -> None:
        signal.setitimer(signal.ITIMER_PROF, 0)
        with open(out, "w") as fh:
            for stack, n in _counts.items():
                fh.write(f"{stack} {n}\n")

    atexit.register(dump)
    signal.signal(signal.SIGPROF, _sample)
    signal.setitimer(signal.ITIMER_PROF, 1 / hz, 1 / hz)


def main(argv: list[str]) -> None:
    if "--" not in argv or argv.index("--") < 1:
        raise SystemExit("usage: python -m sidecar.bench.cpuprof OUT [HZ] -- CLI-ARGS...")
    split = argv.index("--")
    head, args = argv[:split], argv[split + 1 :]
    start(head[0], int(head[1]) if len(head) > 1 else 200)
    from sidecar.cli import main as cli_main

    cli_main(args)


if __name__ == "__main__":
    main(sys.argv[1:])
