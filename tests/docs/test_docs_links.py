"""Relative links in README.md and docs/*.md point at files (and headings) that exist."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
CODE_SPAN = re.compile(r"`+[^`\n]*`+")


def prose(markdown: str) -> str:
    """The text without fenced code blocks and code spans (links inside code are not links)."""
    return CODE_SPAN.sub("", FENCE.sub("", markdown))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading text."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", path.read_text(encoding="utf-8")).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def relative_links(path: Path) -> list[str]:
    links = LINK.findall(prose(path.read_text(encoding="utf-8")))
    return [t for t in links if not re.match(r"^[a-z][a-z0-9+.-]*:", t, re.I)]


def test_helpers():
    assert slug("The cache (`data.cache_dir`)") == "the-cache-datacache_dir"
    assert slug("`rlcore_metrics`") == "rlcore_metrics"
    sample = "see [a](a.md) and [b](b.md#x 'no'), ![img](p.png), `[c](c.md)`, [web](https://x.org)\n```\n[d](d.md)\n```\n"
    assert LINK.findall(prose(sample)) == ["a.md", "p.png", "https://x.org"]


def test_docs_exist():
    assert len(PAGES) > 5 and all(p.suffix == ".md" for p in PAGES)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    if not page.exists():
        pytest.skip(f"{page.name} does not exist yet")
    broken = []
    for target in relative_links(page):
        file_part, _, anchor = target.partition("#")
        dest = (page.parent / unquote(file_part)).resolve() if file_part else page
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target} (no heading with anchor #{anchor} in {dest.name})")
    assert not broken, f"{page.relative_to(ROOT)} has broken links: " + ", ".join(broken)
