"""The README and docs/ stay true to the repository: every relative link resolves (files and headings), every
public name is in the reference, the reference is what the docstrings say, and the README stays a front door."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, flags=re.M)}


def broken_links(page: Path) -> list[str]:
    """The relative links of ``page`` (outside code blocks) whose file or heading does not exist."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+://", target) or target.startswith("mailto:"):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(target)
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = broken_links(page)
    assert not broken, f"{page.relative_to(ROOT)}: {broken}"


def test_the_links_check_can_fail(tmp_path):
    """The check itself, on a page with a good link, a missing file and a missing heading (issue #37: this test
    used to take the page apart by hand and never ran the check)."""
    page = tmp_path / "p.md"
    page.write_text("# Title\n\n[ok](#title) [missing](nowhere.md) [bad anchor](#nope)\n\n```\n[code](skipped.md)\n```\n")
    assert broken_links(page) == ["nowhere.md", "#nope"]


def test_every_public_name_is_in_the_reference_and_the_reference_is_current():
    import remat

    reference = (ROOT / "docs" / "reference.md").read_text()
    missing = [n for n in remat.__all__ if f"## `remat.{n}`" not in reference]
    assert not missing, missing
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "api_reference.py"), "--check"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250, len(lines)
    assert "bash scripts/demo.sh" in "\n".join(lines) and "bash scripts/test.sh" in "\n".join(lines)
