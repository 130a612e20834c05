"""Checks of the built documentation site (``make docs-check``): internal links and anchors, headless browser.

The link checker (scripts/check_docs_links.py) is tested against a small hand-written site whose broken
links are known, then run on the real site when ``make docs`` has built it (docs/_build/html). The browser
check (docs/browser-check/check.mjs: headless Chromium from @sparticuz/chromium) runs where node and its
npm packages are installed (``make docs-check`` installs them).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SITE = ROOT / "docs" / "_build" / "html"
BROWSER_CHECK = ROOT / "docs" / "browser-check"
sys.path.insert(0, str(ROOT / "scripts"))

from check_docs_links import broken_links  # noqa: E402


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def small_site(root: Path) -> Path:
    """Two pages and a style sheet: good links of every kind, and four broken ones."""
    write(root / "_static" / "site.css", "body {}")
    write(
        root / "index.html",
        '<html><head><link rel="stylesheet" href="_static/site.css"></head><body>'
        '<h1 id="top">Start</h1>'
        '<a href="api/page.html">ok</a> <a href="api/page.html#a-class">ok anchor</a> <a href="#top">ok local</a>'
        '<a href="https://example.org/x.html#nowhere">external, not followed</a>'
        '<a href="api/page.html#no-such-id">bad anchor</a> <a href="missing.html">bad file</a>'
        "</body></html>",
    )
    write(
        root / "api" / "page.html",
        '<html><body><dt id="a-class">A</dt><a name="old-style">x</a>'
        '<a href="../index.html#top">ok up</a> <a href="#old-style">ok name</a> <a href="#gone">bad local</a>'
        '<img src="../_static/missing.png"></body></html>',
    )
    return root


def test_link_checker_finds_exactly_the_broken_links(tmp_path):
    """Catches a checker that does not look at anchors or files: make ``broken_links`` skip the ``#id``
    test (or the file test) and the planted bad anchors (or files) go unreported."""
    problems = broken_links(small_site(tmp_path))
    reported = sorted(p.split(": ", 2)[1] for p in problems)
    assert reported == ["#gone", "../_static/missing.png", "api/page.html#no-such-id", "missing.html"], (
        problems
    )


@pytest.mark.skipif(not (SITE / "index.html").is_file(), reason="the site is not built (make docs)")
def test_built_site_has_no_broken_internal_links():
    """Catches a page linking to a heading or page that does not exist (a renamed section, a MyST link
    with a wrong slug): the site ``make docs`` built has no broken internal link or anchor."""
    assert broken_links(SITE) == []


@pytest.mark.skipif(
    not (SITE / "index.html").is_file()
    or shutil.which("node") is None
    or not (BROWSER_CHECK / "node_modules" / "puppeteer-core").is_dir(),
    reason="needs the built site, node and docs/browser-check's npm packages (make docs-check)",
)
def test_pages_render_in_a_headless_browser_without_console_errors():
    """Catches a page whose scripts fail (a missing theme file, a JavaScript error): the start page and an
    API page load in headless Chromium with no console error, no uncaught exception, no failed request."""
    run = subprocess.run(
        ["node", "check.mjs", str(SITE), "index.html", "api/strategies.html"],
        cwd=BROWSER_CHECK,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "2 page(s) rendered in headless Chromium, 0 with errors." in run.stdout
