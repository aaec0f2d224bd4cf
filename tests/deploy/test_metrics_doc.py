"""docs/METRICS.md lists exactly the series the sidecar exports (names as scraped), and no
reference page names a series that does not exist."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

from sidecar.core.metrics import REGISTRY

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "METRICS.md"
#: Modules that register metrics when imported (the run command imports them all).
MODULES = (
    "sidecar.core.load_metrics",
    "sidecar.kvbridge.metrics",
    "sidecar.dynamo.metrics",
    "sidecar.loopwatch",
    "sidecar.tracing",
)


def exported_names() -> set[str]:
    for module in MODULES:
        importlib.import_module(module)
    names = set()
    for family in REGISTRY.collect():
        names.add(family.name + ("_total" if family.type == "counter" else ""))
    return names


def reference_pages() -> list[Path]:
    """README.md and every page under docs/ except the measurement history (docs/results/)."""
    docs = ROOT / "docs"
    return [ROOT / "README.md"] + [
        p for p in sorted(docs.rglob("*.md")) if "results" not in p.relative_to(docs).parts
    ]


def test_every_exported_metric_is_documented_and_nothing_else() -> None:
    documented = set(re.findall(r"^\| `(openengine_[a-z_]+)` \|", DOC.read_text(), re.M))
    exported = {n for n in exported_names() if n.startswith("openengine_")}
    assert exported - documented == set(), "exported but not in docs/METRICS.md"
    assert documented - exported == set(), "in docs/METRICS.md but not exported"


def test_every_series_a_reference_page_names_is_exported() -> None:
    exported = exported_names()
    unknown = sorted(
        f"{page.relative_to(ROOT)}: {name}"
        for page in reference_pages()
        for name in set(re.findall(r"\bopenengine_(?:sidecar|engine)_[a-z_]*[a-z]\b", page.read_text()))
        if name not in exported
    )
    assert unknown == [], f"series named in the docs but not exported: {unknown}"
