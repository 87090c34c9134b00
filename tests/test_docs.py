"""The documentation holds together: every spec citation names a section of docs/spec.md, every relative link in
the README and docs/ points at a file that exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_spec_citation_names_a_section():
    sections = set(re.findall(r"^## (\d+)\. ", (ROOT / "docs" / "spec.md").read_text(), flags=re.M))
    assert sections == {str(n) for n in range(1, 10)}
    sources = [
        f
        for part in ("mhf_dist", "tests", "tools")
        for f in sorted((ROOT / part).rglob("*"))
        if f.suffix in (".py", ".sh", ".yaml") and f.is_file()
    ]
    cited = "".join(
        m.group(0)
        for f in sources
        for m in re.finditer(r"docs/spec\.md §[0-9]+(, §[0-9]+|–§[0-9]+)*", f.read_text())
    )
    numbers = set(re.findall(r"§(\d+)", cited))
    assert numbers and numbers <= sections, sorted(numbers - sections)


def test_relative_links_resolve():
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" not in target:
                assert (page.parent / target).exists(), f"{page.name}: link to missing {target}"


def _anchors(page: Path) -> set[str]:
    """The anchors of a page's headings, as GitHub makes them."""
    headings = re.findall(r"^#+ (.+)$", page.read_text(), flags=re.M)
    return {
        re.sub(r"[^\w\- ]", "", h.strip().lower().replace("`", "")).replace(" ", "-")
        for h in headings
    }


def test_links_to_a_section_name_one_that_exists():
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target, anchor in re.findall(r"\]\(([^)#\s]*)#([^)\s]+)\)", page.read_text()):
            linked = page.parent / target if target else page
            if "://" not in target and linked.suffix == ".md":
                assert anchor in _anchors(linked), (
                    f"{page.name}: link to a missing section {target}#{anchor}"
                )
