"""The documentation site (mkdocs.yml, `make docs`) builds with no warning, which with its link
validation means no link to a missing page or heading; every page under docs/ is in its navigation,
and the home page links every guide page."""

import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
BUILD_TIMEOUT_S = 300


def nav_pages(nav: list) -> list[str]:
    """The page paths of an mkdocs `nav` (entries are `page.md`, `{title: page.md}` or a section
    `{title: [entries]}`), in order."""
    pages = []
    for entry in nav:
        for value in entry.values() if isinstance(entry, dict) else [entry]:
            pages += nav_pages(value) if isinstance(value, list) else [value]
    return pages


def site_nav() -> list[str]:
    return nav_pages(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])


def test_the_site_builds_with_no_warning(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's banner about MkDocs 2.0, not a warning
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")]
    out = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    problems = [line for line in out.stderr.splitlines() if line.startswith(("WARNING", "ERROR"))]
    assert problems == [] and out.returncode == 0, out.stderr[-4000:]
    assert (tmp_path / "site" / "reference" / "recipe.html").is_file()


def test_every_page_under_docs_is_in_the_navigation():
    pages = sorted(str(path.relative_to(DOCS)) for path in DOCS.rglob("*.md"))
    nav = site_nav()
    missing = [page for page in pages if page not in nav]
    assert missing == [], f"add these pages to `nav` in mkdocs.yml: {missing}"
    assert [page for page in nav if page not in pages] == [], "mkdocs.yml's nav names pages that do not exist"
    assert len(nav) == len(set(nav)), "a page is in mkdocs.yml's nav twice"


def test_the_home_page_links_every_guide_page():
    linked = set(re.findall(r"\]\(([^)#\s]+\.md)(?:#[^)]*)?\)", (DOCS / "index.md").read_text()))
    # the results pages are reached from their own index
    guides = [page for page in site_nav() if not page.startswith("results/")] + ["results/index.md"]
    missing = [page for page in guides if page != "index.md" and page not in linked]
    assert missing == [], f"docs/index.md links no page {missing}; add a line for each"
