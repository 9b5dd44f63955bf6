"""Files kept outside docs/ that are pages of the docs site too, and lists as GitHub reads them (an MkDocs hook,
named in mkdocs.yml).

RELIABILITY.md, BENCHMARKS.md and deploy/README.md are read where they are (on GitHub, by people and tests, and
named in error messages and docstrings), so the site takes them at build time rather than keeping a copy that would
drift. Their relative links are written for where they live: each is resolved from its file's folder and pointed at
the page that file is on the site (a root page, or a page under docs/); a link to anything else is left as it is,
so the strict build names it.
"""
from __future__ import annotations

import posixpath
import re
from pathlib import Path

# page on the site -> file in the repository
ROOT_PAGES = {
    "reliability.md": "RELIABILITY.md",
    "benchmarks/current.md": "BENCHMARKS.md",
    "operations/deploy.md": "deploy/README.md",
}
# files that are no page of their own but whose place on the site is known
ELSEWHERE = {"README.md": "index.md"}

LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*(```|~~~)")
LIST_ITEM = re.compile(r"^([-*+]|\d+\.) ")
PARAGRAPH_LINE = re.compile(r"^[^\s|#>-]")  # not indented, not a table row, heading, quote or list item


def site_target(source: str, link: str) -> str | None:
    """The site page a relative link in `source` (a repository path) points at, or None when it has none."""
    path, _, anchor = link.partition("#")
    repo_path = posixpath.normpath(posixpath.join(posixpath.dirname(source), path))
    pages = {file: page for page, file in ROOT_PAGES.items()} | ELSEWHERE
    if repo_path in pages:
        page = pages[repo_path]
    elif repo_path.startswith("docs/"):
        page = repo_path.removeprefix("docs/")
    else:
        return None
    return page + (f"#{anchor}" if anchor else "")


def rewrite_links(text: str, source: str, page: str) -> str:
    def one(match: re.Match) -> str:
        link = match.group(1)
        if link.startswith("#") or re.match(r"^[a-z][a-z0-9+.-]*:", link):
            return match.group(0)
        target = site_target(source, link)
        if target is None:
            return match.group(0)
        path, _, anchor = target.partition("#")
        relative = posixpath.relpath(path, posixpath.dirname(page) or ".")
        return f"]({relative}{'#' + anchor if anchor else ''})"
    return LINK.sub(one, text)


def on_files(files, config):
    from mkdocs.structure.files import File  # imported here: tests read ROOT_PAGES without mkdocs

    root = Path(config.config_file_path).parent
    for page, source in ROOT_PAGES.items():
        text = (root / source).read_text(encoding="utf-8")
        files.append(File.generated(config, page, content=rewrite_links(text, source, page)))
    return files


def open_lists(markdown: str) -> str:
    """A blank line where GitHub starts a list item and Python-Markdown would read on in the paragraph before it: a
    list right after a paragraph line, and the next item after an item's second paragraph (a loose item: its text
    goes on past a blank line or a code block). Nested lists indented by two spaces are mdx_truly_sane_lists' part."""
    out, fenced, previous, loose = [], False, "", False
    for line in markdown.splitlines(keepends=True):
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced and LIST_ITEM.match(line):
            after_paragraph = PARAGRAPH_LINE.match(previous) and not LIST_ITEM.match(previous)
            after_loose_item = loose and previous.strip() and previous[:1].isspace()
            if after_paragraph or after_loose_item:
                out.append("\n")
            loose = False
        elif not fenced and not line.strip():
            loose = True
        out.append(line)
        previous = "" if fenced else line
    return "".join(out)


def on_page_markdown(markdown, page, config, files):
    return open_lists(markdown)
