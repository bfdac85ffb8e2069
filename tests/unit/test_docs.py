"""The docs against the code: docs/configuration.md names every key of the schema (runtime/config.py, as
`llaunch --help` lists them) and every profile, the README links every page of docs/, and every relative
link in the README and docs/ reaches a file and, with a #fragment, one of its headings; the performance page stays
current and reproducible from a checkout."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from llaunch.launcher import config_keys, store

REPO = Path(__file__).resolve().parents[2]
DOCS = sorted((REPO / "docs").glob("*.md"))
CONFIGURATION = REPO / "docs" / "configuration.md"
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # a '#' comment in a code block is no heading
    return {slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, flags=re.M)}


def test_every_key_is_in_the_configuration_page():
    text = CONFIGURATION.read_text()
    missing = [k.name for k in config_keys.all_keys() if f"`{k.name}`" not in text]
    assert not missing, f"keys of runtime/config.py that docs/configuration.md does not name: {missing}"


def test_every_profile_is_in_the_configuration_page():
    text = CONFIGURATION.read_text()
    missing = [f"{g}={p}" for g in store.GROUPS for p in store.profiles(g) if f"`{p}`" not in text]
    assert not missing, f"profiles that docs/configuration.md does not name: {missing}"


def test_the_readme_links_every_page_of_docs():
    readme = REPO / "README.md"
    targets = {(readme.parent / link.split("#")[0]).resolve() for link in LINK.findall(readme.read_text())}
    assert DOCS and not [p.name for p in DOCS if p.resolve() not in targets]


@pytest.mark.parametrize("page", [REPO / "README.md", *DOCS], ids=lambda p: p.name)
def test_relative_links_reach_a_file_and_heading(page):
    for link in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+://", link) or link.startswith("mailto:"):
            continue
        path, _, fragment = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        assert target.exists(), f"{page.name}: {link} does not exist"
        if fragment and target.suffix == ".md":
            assert fragment in anchors(target), f"{page.name}: {link}: no such heading in {target.name}"


def test_the_performance_page_is_current_figures_a_reader_can_reproduce():
    """docs/performance.md stays a page of current figures (≤ 200 lines; the history is in git) whose commands
    run from a checkout: no path outside the repository (../), no words about how this team borrows GPUs."""
    text = (REPO / "docs" / "performance.md").read_text()
    assert len(text.splitlines()) <= 200, "docs/performance.md: keep current figures only (≤ 200 lines)"
    for words in ("../", "device time", "lent machine", "budget_left"):
        assert words not in text, f"docs/performance.md mentions {words!r}"
