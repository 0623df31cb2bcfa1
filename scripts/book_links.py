#!/usr/bin/env python3
"""Checks the links of the built book and of the READMEs that point into it.

Usage: book_links.py HTML_DIR REPO [MARKDOWN...]

- Every page mdBook rendered under HTML_DIR (print.html, toc.html and
  404.html aside: mdBook makes them from the same pages): each `<a href>`
  and `<img src>` that is relative must name a file of the built book, and
  its `#anchor`, if any, an `id` (or `<a name>`) in that page; a bare
  `#anchor` one in the same page. mdbook-linkcheck has already checked the
  files in the Markdown; this adds the anchors, which it does not check.
- Each MARKDOWN file (paths relative to REPO; default README.md and
  deploy/README.md): every relative link must name a file or folder of the
  repository. A link to a book page (docs/src/*.md) with an `#anchor` must
  name an `id` of the rendered page; a link to another Markdown file with an
  anchor, a heading of that file (GitHub's way of naming headings).

External links (http:, https:, mailto: and any other scheme) are skipped:
this machine and CI reach no network but the package registries. Exits 1
naming every broken link, 0 otherwise.
"""

import html.parser
import pathlib
import re
import sys
import urllib.parse

SKIPPED_PAGES = {"print.html", "toc.html", "404.html"}


class Page(html.parser.HTMLParser):
    """The ids a page defines and the links it makes."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.ids = set()
        self.links = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if attrs.get("id"):
            self.ids.add(attrs["id"])
        if tag == "a" and attrs.get("name"):
            self.ids.add(attrs["name"])
        if tag == "a" and attrs.get("href") is not None:
            self.links.append(attrs["href"])
        if tag == "img" and attrs.get("src") is not None:
            self.links.append(attrs["src"])


def parse(path, cache={}):
    if path not in cache:
        page = Page()
        page.feed(path.read_text(encoding="utf-8"))
        cache[path] = page
    return cache[path]


def external(link):
    """A link with a scheme (https:, mailto:, ...) or to another host."""
    parts = urllib.parse.urlsplit(link)
    return bool(parts.scheme) or bool(parts.netloc)


def check_page(html_dir, page_path):
    problems = []
    page = parse(page_path)
    checked = skipped = 0
    for link in page.links:
        if external(link):
            skipped += 1
            continue
        checked += 1
        parts = urllib.parse.urlsplit(link)
        fragment = urllib.parse.unquote(parts.fragment)
        if parts.path:
            target = (page_path.parent / urllib.parse.unquote(parts.path)).resolve()
            if parts.path.endswith("/"):
                target = target / "index.html"
            if html_dir not in target.parents:
                problems.append(f"{link}: outside the built book")
                continue
            if not target.is_file():
                problems.append(f"{link}: no such file in the built book")
                continue
        else:
            target = page_path
        if fragment and target.suffix == ".html" and fragment not in parse(target).ids:
            problems.append(f"{link}: no anchor #{fragment} in {target.relative_to(html_dir)}")
    return problems, checked, skipped


def github_slugs(markdown):
    """The anchors GitHub gives a Markdown file's headings."""
    slugs = set()
    counts = {}
    in_code = False
    for line in markdown.splitlines():
        if line.lstrip().startswith("```"):
            in_code = not in_code
            continue
        match = None if in_code else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        text = re.sub(r"[^\w\- ]", "", match.group(1).lower()).replace(" ", "-")
        n = counts.get(text, 0)
        counts[text] = n + 1
        slugs.add(text if n == 0 else f"{text}-{n}")
    return slugs


def markdown_links(text):
    """The inline links and images of a Markdown text, code left out."""
    text = re.sub(r"^\s*```.*?^\s*```", "", text, flags=re.S | re.M)
    text = re.sub(r"`[^`\n]*`", "", text)
    return re.findall(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", text)


def check_markdown(repo, html_dir, md_path):
    problems = []
    text = md_path.read_text(encoding="utf-8")
    checked = skipped = 0
    book_src = (repo / "docs" / "src").resolve()
    for link in markdown_links(text):
        if external(link):
            skipped += 1
            continue
        checked += 1
        parts = urllib.parse.urlsplit(link)
        fragment = urllib.parse.unquote(parts.fragment)
        if not parts.path:
            if fragment not in github_slugs(text):
                problems.append(f"{link}: no heading #{fragment} in this file")
            continue
        target = (md_path.parent / urllib.parse.unquote(parts.path)).resolve()
        if not target.exists():
            problems.append(f"{link}: no such file or folder")
            continue
        if not fragment:
            continue
        if book_src in target.parents and target.suffix == ".md":
            rendered = html_dir / target.relative_to(book_src).with_suffix(".html")
            if not rendered.is_file():
                problems.append(f"{link}: the book has no page for {target.relative_to(repo)}")
            elif fragment not in parse(rendered).ids:
                problems.append(f"{link}: no anchor #{fragment} in the book's {rendered.relative_to(html_dir)}")
        elif target.suffix == ".md":
            if fragment not in github_slugs(target.read_text(encoding="utf-8")):
                problems.append(f"{link}: no heading #{fragment} in {target.relative_to(repo)}")
    return problems, checked, skipped


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    html_dir = pathlib.Path(sys.argv[1]).resolve()
    repo = pathlib.Path(sys.argv[2]).resolve()
    markdown = sys.argv[3:] or ["README.md", "deploy/README.md"]
    pages = sorted(p for p in html_dir.rglob("*.html") if p.name not in SKIPPED_PAGES)
    if not pages:
        sys.exit(f"book_links: no pages under {html_dir}: build the book first (scripts/book.sh)")
    broken = []
    checked = skipped = 0
    for page in pages:
        problems, c, s = check_page(html_dir, page)
        broken += [f"{page.relative_to(html_dir)}: {p}" for p in problems]
        checked += c
        skipped += s
    for name in markdown:
        problems, c, s = check_markdown(repo, html_dir, repo / name)
        broken += [f"{name}: {p}" for p in problems]
        checked += c
        skipped += s
    for line in broken:
        print(f"broken link: {line}", file=sys.stderr)
    print(
        f"book links: {checked} checked in {len(pages)} pages and {len(markdown)} READMEs, "
        f"{len(broken)} broken; {skipped} external links not checked (no network)"
    )
    sys.exit(1 if broken else 0)


if __name__ == "__main__":
    main()
