"""The two test tiers: ``scripts/test`` (fast) deselects every marker pyproject.toml registers as
a reason to be slow or a need beyond PyPI, and CI (``.ci/run``) runs the full tier."""

from __future__ import annotations

import re
import tomllib

from tests.deploy.helpers import ROOT


def test_the_fast_tier_deselects_every_registered_reason() -> None:
    ini = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    registered = {line.split(":", 1)[0] for line in ini["markers"]}
    fast = re.search(r'^FAST="not \(([a-z_ ]+)\)"$', (ROOT / "scripts" / "test").read_text(), re.M)
    assert fast, 'scripts/test: no FAST="not (...)" line'
    # vllm_destructive orders tests within tests/vllm (all marked vllm); no reason of its own
    reasons = {name for name in registered if not name.endswith("_destructive")}
    assert set(fast.group(1).split(" or ")) == reasons


def test_ci_runs_the_full_tier() -> None:
    assert re.search(r"^exec scripts/test --all\b", (ROOT / ".ci" / "run").read_text(), re.M)
