"""A simulated engine whose ``GetLoad.attributes`` are large, as after many Aborts (test helper).

    BIG_LOAD_IDS=N python -m tests.core.big_load_engine MOCK-ENGINE-FLAGS...

Fills the engine's ``aborts_received_by_id`` ground truth with ``N`` request ids (about 30
bytes each in the answer) before its first ``GetLoad`` answer; otherwise ``mock-engine``.
"""

from __future__ import annotations

import os
import sys

from sidecar.mock.services import SimulatedControl
from sidecar.openengine import pb


def main(argv: list[str]) -> None:
    ids = int(os.environ.get("BIG_LOAD_IDS", "0"))
    full_get_load = SimulatedControl.get_load

    async def get_load(self: SimulatedControl, message: pb.GetLoadRequest) -> pb.LoadInfo:
        seen = self.engine.counters.aborts_received_by_id
        if len(seen) < ids:
            seen.update({f"sc-000000000000-{i}": 1 for i in range(ids)})
        return await full_get_load(self, message)

    SimulatedControl.get_load = get_load  # type: ignore[method-assign]
    from sidecar.cli import main as cli_main

    cli_main(["mock-engine", *argv])


if __name__ == "__main__":
    main(sys.argv[1:])
