"""Run ``mock-engine`` for the benchmark, optionally without grpclib's 100-stream cap.

    python -m sidecar.bench.engine_proc [--max-concurrent-streams N] [--lean-load-attributes] MOCK-ENGINE-FLAGS...

grpclib servers advertise h2's default ``SETTINGS_MAX_CONCURRENT_STREAMS = 100`` per
HTTP/2 connection, so the simulated engine admits at most 100 Generate streams per client
connection (a client past that waits, silently, inside grpclib). Engines serving with
grpcio (C-core) or grpc-go advertise no such limit by default. To measure the sidecar at
1,000 / 10,000 streams instead of that artefact, this launcher makes the engine advertise
``N`` (0 keeps grpclib's default). ``--lean-load-attributes``: see :func:`lean_load_attributes`.
Benchmark-only: these patch the engine process, nothing else.
"""

from __future__ import annotations

import sys

from sidecar.openengine.serving._grpclib_internals import advertise_max_concurrent_streams


def lean_load_attributes() -> None:
    """GetLoad answers carry only the scalar counters unless the caller sends ``mock-report``
    metadata (the benchmark's own ground-truth queries do).

    The simulated engine's default attributes (``recent_requests``, ``aborts_received_by_id``
    — up to 10,000 ids) make a GetLoad answer 10-270 KB, which the sidecar's load poller
    parses on its event loop every second: 11-190 ms stalls that no real engine's small
    attributes cause. Measured separately with ``--engine-load-attributes full``.
    """
    from sidecar.mock.services import SimulatedControl
    from sidecar.openengine import pb
    from sidecar.openengine.serving.grpc_server import request_metadata

    full_get_load = SimulatedControl.get_load

    async def get_load(self: SimulatedControl, message: pb.GetLoadRequest) -> pb.LoadInfo:
        if any(key == "mock-report" for key, _ in request_metadata()):
            return await full_get_load(self, message)
        return self.engine.load(message.include_per_rank, lean=True)

    SimulatedControl.get_load = get_load  # type: ignore[method-assign]


def main(argv: list[str]) -> None:
    limit = 0
    lean = False
    while argv[:1] in (["--max-concurrent-streams"], ["--lean-load-attributes"]):
        if argv[0] == "--lean-load-attributes":
            lean, argv = True, argv[1:]
        else:
            limit, argv = int(argv[1]), argv[2:]
    if limit > 0:
        advertise_max_concurrent_streams(limit)
    if lean:
        lean_load_attributes()
    from sidecar.cli import main as cli_main

    cli_main(["mock-engine", *argv])


if __name__ == "__main__":
    main(sys.argv[1:])
