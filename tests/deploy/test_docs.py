"""The reference docs stay what they claim to be: about the code as it is, within their size,
their links and cited tests real. History (issue numbers, optimisation records, dated runs) lives
in docs/results/ and CHANGELOG.md only."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from sidecar.conformance.runner import all_checks

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
#: README.md plus every Markdown page under docs/ except the measurement history.
REFERENCE = [ROOT / "README.md"] + [
    p for p in sorted(DOCS.rglob("*.md")) if "results" not in p.relative_to(DOCS).parts
]
#: What a reader needs in one sitting: the reference, at most this many words (``wc -w``).
WORD_BUDGET = 25_000
#: History a reader of the repository cannot follow: tracker numbers, optimisation records,
#: a branch and a commit that were never merged.
HISTORY = re.compile(r"\bissues? #?\d+|\boptimi[sz]ations? #?\d+|\bh19\b|887f4bd", re.I)
#: Code being rewritten elsewhere; its docstrings are fixed there. Drop an entry once it is.


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def test_the_reference_fits_its_word_budget() -> None:
    words = sum(len(p.read_text().split()) for p in REFERENCE)
    assert words <= WORD_BUDGET, f"README.md + docs/ (without docs/results/): {words} words > {WORD_BUDGET}"


def test_no_history_in_the_reference_docs() -> None:
    found = [
        f"{_rel(p)}:{n}: {line.strip()}"
        for p in REFERENCE
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if HISTORY.search(line)
    ]
    assert found == [], "move history to docs/results/ or CHANGELOG.md:\n" + "\n".join(found)


def _comments_and_docstrings(source: str) -> list[tuple[int, str]]:
    """(line, text) of every docstring and ``#`` comment of a module."""
    out: list[tuple[int, str]] = []
    tree = ast.parse(source)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            value = body[0].value
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                out += [(body[0].lineno + i, line) for i, line in enumerate(value.value.splitlines())]
    out += [(n, line[line.index("#") :]) for n, line in enumerate(source.splitlines(), 1) if "#" in line]
    return out


def test_no_history_in_docstrings_and_comments() -> None:
    found = []
    for path in sorted((ROOT / "sidecar").rglob("*.py")):
        rel = _rel(path)
        if "_generated" in path.parts:
            continue
        found += [
            f"{rel}:{n}: {text.strip()}"
            for n, text in _comments_and_docstrings(path.read_text())
            if HISTORY.search(text)
        ]
    assert found == [], "docstrings and comments describe the code as it is:\n" + "\n".join(found)


def _slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {_slug(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}


@pytest.mark.parametrize("page", REFERENCE + sorted((DOCS / "results").glob("*.md")), ids=_rel)
def test_every_relative_link_resolves(page: Path) -> None:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists() or (anchor and dest.suffix == ".md" and anchor not in _anchors(dest)):
            broken.append(target)
    assert broken == [], f"{_rel(page)}: {broken}"


def _test_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}


def _cited_file(file: str, last: Path | None) -> Path | None:
    """Where a cited test file is: ``tests/…`` from the root, ``dir/test_x.py`` under tests/, a
    bare ``test_x.py`` beside the last file cited (else the one such file under tests/)."""
    if file.startswith("tests/"):
        return ROOT / file
    if "/" in file:
        return ROOT / "tests" / file
    if last is not None and (last.parent / file).exists():
        return last.parent / file
    found = sorted((ROOT / "tests").rglob(file))
    return found[0] if len(found) == 1 else None


@pytest.mark.parametrize("page", REFERENCE, ids=_rel)
def test_every_test_the_docs_cite_exists(page: Path) -> None:
    """A cited test file exists and ``…::test_name`` is a test in it; a bare ``::test_name``
    refers to the last file cited before it."""
    missing = []
    last: Path | None = None
    for file, name in re.findall(r"`((?:[\w]+/)*test_\w+\.py)?(::\w+)?", page.read_text()):
        if file:
            path = _cited_file(file, last)
            if path is None or not path.exists():
                missing.append(file)
                last = None
                continue
            last = path
        if name and last is not None and name[2:] not in _test_names(last):
            missing.append(f"{_rel(last)}{name}")
    assert missing == [], f"{_rel(page)} cites what does not exist: {missing}"


def test_every_conformance_check_is_in_docs_conformance_md() -> None:
    doc = (DOCS / "CONFORMANCE.md").read_text()
    assert [c.id for c in all_checks() if f"`{c.id}`" not in doc] == []
