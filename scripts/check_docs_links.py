"""Check the built documentation site: every internal link and anchor resolves.

Usage: ``python scripts/check_docs_links.py docs/_build/html`` (``make docs-check`` runs it). Parses every
HTML page with the standard library's ``html.parser``, follows each relative ``href``/``src`` (links,
images, scripts, style sheets) to its file, and checks that a ``#fragment`` names an ``id`` (or an
``<a name=...>``) on the target page. External links (``http:``, ``mailto:``, ...) are not followed: the
build is offline. Exits with status 1 and one line per broken link.
"""

from __future__ import annotations

import argparse
import sys
from functools import cache
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

LINK_ATTRIBUTES = {
    "a": "href",
    "link": "href",
    "img": "src",
    "script": "src",
    "iframe": "src",
    "source": "src",
}


class PageParser(HTMLParser):
    """Collects a page's ids (anchors) and the links it makes."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.ids: set[str] = set()
        self.links: list[tuple[int, str]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = dict(attrs)
        if values.get("id"):
            self.ids.add(values["id"])
        if tag == "a" and values.get("name"):
            self.ids.add(values["name"])
        attribute = LINK_ATTRIBUTES.get(tag)
        if attribute and values.get(attribute):
            self.links.append((self.getpos()[0], values[attribute]))


@cache
def parse(path: Path) -> PageParser:
    """The parsed page (each page is parsed once, as a source of links and as a link target)."""
    parser = PageParser()
    parser.feed(path.read_text(encoding="utf-8", errors="replace"))
    parser.close()
    return parser


def is_internal(url: str) -> bool:
    """Whether ``url`` points into the site (no scheme, no host: a relative path or a bare ``#id``)."""
    parts = urlsplit(url)
    return not parts.scheme and not parts.netloc and not url.startswith("//")


def broken_links(site: Path) -> list[str]:
    """One line per internal link of ``site`` whose file or ``#id`` does not exist."""
    site = site.resolve()
    problems = []
    for page in sorted(site.rglob("*.html")):
        for line, url in parse(page).links:
            if not is_internal(url):
                continue
            parts = urlsplit(url)
            target = page if not parts.path else (page.parent / unquote(parts.path)).resolve()
            if target.is_dir():
                target = target / "index.html"
            where = f"{page.relative_to(site)}:{line}: {url}"
            if not target.is_relative_to(site):
                problems.append(f"{where}: points outside the site")
            elif not target.is_file():
                problems.append(f"{where}: no file {target.relative_to(site)}")
            elif (
                parts.fragment
                and target.suffix == ".html"
                and unquote(parts.fragment) not in parse(target).ids
            ):
                problems.append(f"{where}: no id {parts.fragment!r} in {target.relative_to(site)}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("site", type=Path, help="the built HTML folder, e.g. docs/_build/html")
    args = parser.parse_args(argv)
    if not (args.site / "index.html").is_file():
        print(f"{args.site} has no index.html: build the site first (make docs).", file=sys.stderr)
        return 2
    problems = broken_links(args.site)
    pages = len(list(args.site.rglob("*.html")))
    for problem in problems:
        print(problem)
    print(f"{pages} pages checked, {len(problems)} broken internal link(s).")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
