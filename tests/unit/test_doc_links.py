"""The docs hold together: every relative link resolves, index.md lists every top-level document, and
docs/ stays short at its top level (runs live under docs/runs/)."""

import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def _markdown_files() -> list[Path]:
    files = [ROOT / "README.md", *DOCS.rglob("*.md"), *(ROOT / "deploy").rglob("*.md")]
    return [*files, *(ROOT / "models").rglob("*.md")]


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: links and code marks dropped, lower case, punctuation out."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"[^\w\- ]", "", text.replace("`", "").replace("*", "").strip().lower())
    return text.replace(" ", "-")


@functools.cache
def _anchors(path: Path) -> set[str]:
    anchors: set[str] = set()
    for heading in re.findall(r"^#+\s+(.*)$", FENCE.sub("", path.read_text()), re.M):
        slug, n = _slug(heading), 0
        while (slug if n == 0 else f"{slug}-{n}") in anchors:
            n += 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def test_every_relative_link_in_the_docs_resolves():
    broken = []
    for doc in _markdown_files():
        for target in LINK.findall(FENCE.sub("", doc.read_text())):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc
            if not dest.exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target}")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_index_lists_every_top_level_document():
    index = (DOCS / "index.md").read_text()
    names = [p.name for p in sorted(DOCS.glob("*.md")) if p.name != "index.md"]
    unlisted = [name for name in names if f"]({name}" not in index]
    assert not unlisted, f"docs/index.md does not list {unlisted}"


def test_the_top_level_of_docs_stays_short():
    entries = sorted(p.name for p in DOCS.iterdir())
    assert len(entries) <= 20, f"{len(entries)} entries at the top of docs/ (a run's output goes in runs/)"
