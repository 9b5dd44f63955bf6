"""The documentation as users read it (issue 43.5): a short README, and a docs site whose nav names only pages that
exist. `make docs` (mkdocs build --strict, in CI after `make test`) checks every link; this keeps the layout honest
without building the site."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README_MAX_LINES = 250


def nav_pages(nav) -> list[str]:
    """Every page path named in mkdocs.yml's nav, however deep its sections nest."""
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, list):
        return [page for item in nav for page in nav_pages(item)]
    if isinstance(nav, dict):
        return [page for value in nav.values() for page in nav_pages(value)]
    raise AssertionError(f"mkdocs.yml nav: unexpected entry {nav!r}")


def hook():
    """docs/hooks/root_pages.py, the MkDocs hook (it imports mkdocs only when MkDocs calls it)."""
    spec = importlib.util.spec_from_file_location("root_pages", DOCS / "hooks" / "root_pages.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def root_pages() -> dict[str, str]:
    """Pages the hook takes from files outside docs/."""
    return hook().ROOT_PAGES


def mkdocs_config() -> dict:
    return yaml.safe_load((ROOT / "mkdocs.yml").read_text())


def test_readme_is_at_most_250_lines_and_keeps_the_two_commands():
    readme = (ROOT / "README.md").read_text()
    lines = readme.count("\n")
    assert lines <= README_MAX_LINES, (f"README.md has {lines} lines, at most {README_MAX_LINES} allowed: move the "
                                       f"detail to a page under docs/ and link it")
    for command in ("make demo", "make test"):
        assert command in readme, f"README.md no longer shows `{command}`, one of the two commands a new user runs"


def test_every_page_in_the_nav_exists():
    generated = root_pages()
    missing = [page for page in nav_pages(mkdocs_config()["nav"])
               if not (DOCS / page).is_file() and page not in generated]
    assert missing == [], f"mkdocs.yml's nav names pages that do not exist under docs/: {missing}"


def test_every_page_taken_from_outside_docs_exists_and_does_not_shadow_a_docs_page():
    for page, source in root_pages().items():
        assert (ROOT / source).is_file(), f"docs/hooks/root_pages.py: {page} is taken from {source}, which is missing"
        assert not (DOCS / page).exists(), f"docs/{page} exists and {source} is also published as {page}: keep one"


def test_the_hook_points_links_at_the_pages_their_files_are_on_the_site():
    module = hook()
    text = ("[runs](docs/benchmarks/history/w-fair.md), [failover](RELIABILITY.md#failover), "
            "[spec](https://example.com/a.md), [here](#summary), [code](producer/quotas.py)")
    assert module.rewrite_links(text, "BENCHMARKS.md", "benchmarks/current.md") == (
        "[runs](history/w-fair.md), [failover](../reliability.md#failover), [spec](https://example.com/a.md), "
        "[here](#summary), [code](producer/quotas.py)")
    assert module.rewrite_links("[acl](redis/acl.conf), [top](../README.md)", "deploy/README.md",
                                "operations/deploy.md") == "[acl](redis/acl.conf), [top](../index.md)"


def test_the_hook_opens_lists_where_github_does():
    """README.md and the pages are written for GitHub, where a list may follow a paragraph line directly; the site's
    Markdown would read such items as the paragraph's text (the architecture page's invariants were one line)."""
    module = hook()
    text = ("**Invariants.**\n1. one\n2. two\n\n- a\n  more of a\n\n  a's second paragraph\n- b\n- c\n"
            "```\ncode:\n- not a list\n```\n")
    assert module.open_lists(text) == ("**Invariants.**\n\n1. one\n2. two\n\n- a\n  more of a\n\n"
                                       "  a's second paragraph\n\n- b\n- c\n```\ncode:\n- not a list\n```\n")


def test_every_history_page_of_the_benchmarks_is_in_the_nav_and_linked_from_benchmarks_md():
    nav = set(nav_pages(mkdocs_config()["nav"]))
    history = sorted(str(path.relative_to(DOCS)) for path in (DOCS / "benchmarks" / "history").glob("*.md"))
    assert history, "docs/benchmarks/history/ holds no pages"
    assert [page for page in history if page not in nav] == []
    linked = set(re.findall(r"\]\(docs/(benchmarks/history/[\w.-]+\.md)\)", (ROOT / "BENCHMARKS.md").read_text()))
    assert [page for page in history if page not in linked] == [], "BENCHMARKS.md's table links no row to these"
