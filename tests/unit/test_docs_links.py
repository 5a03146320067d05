"""Every relative link in README.md and docs/*.md names a file that exists, and every
#anchor a heading of that page; every file under docs/ is linked or named by a page."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {anchor(m) for m in re.findall(r"^#{1,6} +(.+)$", text, re.M)}


def links(page: Path) -> list[str]:
    return LINK.findall(FENCE.sub("", page.read_text()))


def test_every_relative_link_resolves() -> None:
    bad = []
    for page in PAGES:
        for target in links(page):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            path, _, frag = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                bad.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif frag and dest.suffix == ".md" and frag not in anchors(dest):
                bad.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not bad, "\n".join(bad)


def test_the_anchor_rule() -> None:
    assert anchor("Real vLLM on one H200 (the product path)") == (
        "real-vllm-on-one-h200-the-product-path"
    )
    assert anchor("2k / 8k / 32k under MPS") == "2k--8k--32k-under-mps"
    assert anchor("What differs from vLLM's in-tree `NixlPushConnector`") == (
        "what-differs-from-vllms-in-tree-nixlpushconnector"
    )


def test_every_docs_file_is_referenced() -> None:
    """No run file is left behind that no page names (superseded runs live in git)."""
    text = "\n".join(p.read_text() for p in PAGES)
    docs = ROOT / "docs"
    orphans = []
    for f in sorted(docs.rglob("*")):
        if not f.is_file() or f.suffix == ".md" or f.name == "reliability.json":
            continue
        rel = f.relative_to(docs).as_posix()
        # A page names a file by its path under docs/, or links the directory that holds it.
        if rel in text or f"{f.parent.relative_to(docs).as_posix()}/" in text:
            continue
        orphans.append(rel)
    assert not orphans, "files under docs/ that no page names: " + ", ".join(orphans)


def test_docs_stay_small() -> None:
    """Only current results live in docs/ (history is in git): under 1.5 MB (issue 40)."""
    files = [p for p in (ROOT / "docs").rglob("*") if p.is_file()]
    total = sum(p.stat().st_size for p in files)
    assert total < 1_500_000, f"docs/ holds {total:,} bytes in {len(files)} files"
