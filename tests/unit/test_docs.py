"""The reference in README.md and docs/: the settings page is the code's table, and every
relative link of every page leads to a file and heading that exist."""

import re
from pathlib import Path

import pytest

from embedsvc.settings import REGENERATE, SETTINGS_PAGE, Settings, settings_page

REPO = Path(__file__).parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def test_the_settings_page_is_the_settings_table():
    page = REPO / SETTINGS_PAGE
    assert page.exists() and page.read_text() == settings_page(), (
        f"{SETTINGS_PAGE} differs from the Settings table in embedsvc/settings.py: "
        f"regenerate it with `{REGENERATE}` and commit it")


def test_the_settings_page_names_every_setting():
    page = settings_page()
    for name in Settings.__dataclass_fields__:
        assert f"| `{name.upper()}` | `EMBEDSVC_{name.upper()}` |" in page


def anchors(markdown: str) -> set[str]:
    """GitHub's ids for a page's headings: lower case, punctuation out, spaces to dashes."""
    titles = re.findall(r"^#+\s+(.+?)\s*$", _FENCE.sub("", markdown), re.M)
    return {re.sub(r"[^\w\- ]", "", t.lower()).replace(" ", "-") for t in titles}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_leads_somewhere(page):
    text = _FENCE.sub("", page.read_text())
    for target in _LINK.findall(text):
        if re.match(r"^[a-z]+:", target):
            continue  # http(s), mailto: not checked offline
        path, _, anchor = target.partition("#")
        where = (page.parent / path).resolve() if path else page
        assert where.exists(), f"{page.name} links to {target}, which does not exist"
        if anchor and where.suffix == ".md":
            assert anchor in anchors(where.read_text()), (
                f"{page.name} links to {target}: {where.name} has no such heading")
