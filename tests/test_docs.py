"""The docs point at things that exist: every relative link (and its #anchor) in the repository's
Markdown files, and every ``path/to/module.py`` they name.

A module path resolves against the repository root, the document's own folder, or ``backend/``
(docs/architecture.md names the engine's modules from there, as ``engine/engine.py``). Paths that
belong to other software are listed in :data:`EXTERNAL` with their owner; a path named in a
fenced code block counts like any other.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
MODULE_ROOTS = (REPO, REPO / "backend")
# Path prefixes that name other software's files, not this repository's.
EXTERNAL = {
    "backends/": "a Triton server's backend directory (backends/<name>/model.py)",
    "vllm/": "vLLM's source tree",
}
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
MODULE = re.compile(r"(?<![\w/.$<>-])((?:[\w.-]+/)+[\w.-]+\.py)\b")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def markdown_files() -> list[Path]:
    skip = {"build", "node_modules"}
    return sorted(p for p in REPO.rglob("*.md")
                  if not any(part.startswith(".") or part in skip or part.endswith(".egg-info")
                             for part in p.relative_to(REPO).parts))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`([^`]*)`", r"\1", heading.strip()).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text())
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, re.M)}


DOCS = markdown_files()


def test_the_docs_are_found():
    names = {p.relative_to(REPO).as_posix() for p in DOCS}
    assert {"README.md", "docs/benchmarks.md", "docs/migrating-from-vllm-backend.md",
            "model_repository/README.md"} <= names


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_relative_links_lead_somewhere(doc):
    broken = []
    for target in LINK.findall(FENCE.sub("", doc.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):      # http:, https:, mailto:
            continue
        path_part, _, anchor = target.partition("#")
        dest = (doc.parent / path_part).resolve() if path_part else doc
        if not dest.exists():
            broken.append(f"{target}: {dest} does not exist")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(REPO)}")
    assert not broken, "\n".join(broken)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_named_modules_exist(doc):
    missing = []
    for n, line in enumerate(doc.read_text().splitlines(), 1):
        for path in MODULE.findall(line):
            if path.startswith(tuple(EXTERNAL)):
                continue
            if not any((root / path).is_file() for root in (*MODULE_ROOTS, doc.parent)):
                missing.append(f"line {n}: {path}")
    assert not missing, f"{doc.relative_to(REPO)} names modules that do not exist:\n" + "\n".join(missing)


def test_the_checks_catch_what_they_look_for(tmp_path):
    """A broken link, a missing anchor and a stale module path are each found."""
    doc = tmp_path / "x.md"
    doc.write_text("# Title here\n[ok](#title-here) [bad](#nope) [gone](missing.md) `backend/nowhere.py`\n")
    found = [t for t in LINK.findall(doc.read_text())]
    assert found == ["#title-here", "#nope", "missing.md"]
    assert anchors(doc) == {"title-here"}
    assert MODULE.findall(doc.read_text()) == ["backend/nowhere.py"]
    assert not (REPO / "backend/nowhere.py").exists()
