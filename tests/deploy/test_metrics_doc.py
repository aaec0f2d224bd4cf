"""docs/METRICS.md lists exactly the series the sidecar exports (names as scraped)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

from sidecar.core.metrics import REGISTRY

DOC = Path(__file__).resolve().parents[2] / "docs" / "METRICS.md"
#: Modules that register metrics when imported (the run command imports them all).
MODULES = (
    "sidecar.core.load_metrics",
    "sidecar.kvbridge.metrics",
    "sidecar.dynamo.metrics",
    "sidecar.loopwatch",
)


def exported_names() -> set[str]:
    for module in MODULES:
        importlib.import_module(module)
    names = set()
    for family in REGISTRY.collect():
        names.add(family.name + ("_total" if family.type == "counter" else ""))
    return names


def test_every_exported_metric_is_documented_and_nothing_else() -> None:
    documented = set(re.findall(r"^\| `(openengine_[a-z_]+)` \|", DOC.read_text(), re.M))
    exported = {n for n in exported_names() if n.startswith("openengine_")}
    assert exported - documented == set(), "exported but not in docs/METRICS.md"
    assert documented - exported == set(), "in docs/METRICS.md but not exported"
