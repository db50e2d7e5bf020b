"""GET /docs in real headless Chromium: every route of /openapi.json listed, nothing fetched
from another host, and "Try it out" embedding a text through the live server.

Set API_PAGE_SCREENSHOT to a path to keep the screenshot (docs/img/api-page.png is one).
"""

from __future__ import annotations

import json
import os
import shutil
from urllib.parse import urlsplit

import numpy as np
import pytest

from .browser import browser_page, chromium
from .conftest import cosine


@pytest.fixture(scope="module", autouse=True)
def _chromium():
    assert chromium() is not None, "needs Debian's chromium: make tools installs it"

LISTED = """Array.from(document.querySelectorAll('.opblock')).map(b => [
  b.querySelector('.opblock-summary-method').textContent,
  b.querySelector('.opblock-summary-path').getAttribute('data-path')])"""
BLOCK = """Array.from(document.querySelectorAll('.opblock')).find(b =>
  b.querySelector('.opblock-summary-method').textContent === 'POST' &&
  b.querySelector('.opblock-summary-path').getAttribute('data-path') === '/embed')"""
TEXT = "hello from the docs page"


def try_embed(page) -> tuple[str, str]:
    """Expand POST /embed, (the page starts in "Try it out"), send a body, press "Execute":
    the status and body the page shows."""
    page.evaluate(f"({BLOCK}).querySelector('.opblock-summary-control').click()")
    assert page.wait_for(f"(({BLOCK}).querySelector('.try-out__btn') || {{}}).textContent"
                         ) == "Cancel"  # already trying it out; "Cancel" would leave
    page.wait_for(f"!!({BLOCK}).querySelector('textarea.body-param__text')")
    page.evaluate(f"""(() => {{
      const area = ({BLOCK}).querySelector('textarea.body-param__text');
      const set = Object.getOwnPropertyDescriptor(HTMLTextAreaElement.prototype, 'value').set;
      set.call(area, {json.dumps(json.dumps({"inputs": TEXT}))});
      area.dispatchEvent(new Event('input', {{bubbles: true}}));
    }})()""")
    page.evaluate(f"({BLOCK}).querySelector('button.execute').click()")
    row = ".live-responses-table tr.response"
    status = page.wait_for(f"""(() => {{
      const cell = ({BLOCK}).querySelector('{row} .response-col_status');
      return cell && cell.textContent.trim(); }})()""")
    body = page.wait_for(f"""(() => {{
      const code = ({BLOCK}).querySelector('{row} .response-col_description pre');
      return code && code.textContent; }})()""")
    return status, body


def test_docs_page_lists_every_route_fetches_locally_and_tries_one_out(served, tmp_path):
    with served.client() as c:
        doc = c.get("/openapi.json").json()
        want_vector = np.array(c.post("/embed", json={"inputs": TEXT}).json()[0])
    described = {(method.upper(), path) for path, ops in doc["paths"].items() for method in ops}
    with browser_page(served.url + "/docs") as page:
        page.wait_for(f"document.querySelectorAll('.opblock').length >= {len(described)}")
        assert {tuple(pair) for pair in page.evaluate(LISTED)} == described
        shot = tmp_path / "api-page.png"
        page.screenshot(shot)
        status, body = try_embed(page)
        requested = list(page.requested)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if os.environ.get("API_PAGE_SCREENSHOT"):
        shutil.copyfile(shot, os.environ["API_PAGE_SCREENSHOT"])
    assert status == "200", body
    assert cosine(np.array(json.loads(body)[0]), want_vector)[0] > 0.9999
    hosts = {urlsplit(u).netloc for u in requested if not u.startswith("data:")}
    assert hosts == {urlsplit(served.url).netloc}, requested
    paths = {urlsplit(u).path for u in requested}
    assert {"/docs", "/docs/swagger-ui-bundle.js", "/docs/swagger-ui.css", "/openapi.json",
            "/embed"} <= paths
