"""The documentation: the site builds with ``mkdocs build --strict``, and README.md stays a front page.

mkdocs.yml's ``validation`` makes a link to a missing page, a missing ``#anchor`` and an unrecognised link warnings,
and ``strict`` turns any warning into a failed build, so the build itself checks every link between pages. The
README and BENCHMARKS.md live outside ``docs/``: their links into it are checked here against the built site (a
file, and an anchor the page really has).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from helpers import ROOT, build_docs_site
from mkdocs.exceptions import Abort

MAX_README_LINES = 200
"""The README is the front page: what, two commands, a quick start, links. The manual is docs/."""

TWO_COMMANDS = ("make demo   # creates .venv, installs, prepares the embedded corpus, trains recipes/tiny.yaml, "
                "evaluates the export\n"
                "make test   # creates .venv, installs, runs the test suite\n")
"""The README's fresh-machine block, as CI (.ci/run) runs it."""

_LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.fixture(scope="module")
def site(docs_site) -> Path:
    return docs_site


def page_html(site: Path, page: str) -> Path:
    """The built HTML of a page of docs/ (``benchmarks/05-mfu.md`` -> ``benchmarks/05-mfu.html``: the offline plugin
    names each page's file, so that links work from disk)."""
    return site / (page[: -len(".md")] + ".html")


def broken_links(markdown: str, site: Path, root: Path = ROOT) -> list[str]:
    """Each relative link of a Markdown file at the repository root whose file, or whose anchor in the built
    site (for a page of docs/), does not exist."""
    broken = []
    for target in _LINK.findall(markdown):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path, _, anchor = target.partition("#")
        if not (root / path).exists():
            broken.append(f"{target}: no file {path}")
        elif anchor and path.startswith("docs/") and path.endswith(".md"):
            html = page_html(site, path[len("docs/"):])
            if f'id="{anchor}"' not in html.read_text(encoding="utf-8"):
                broken.append(f"{target}: no anchor #{anchor} in {path}")
    return broken


def test_every_page_in_docs_is_built(site):
    pages = sorted(p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md"))
    assert "architecture.md" in pages and "reference/keys.md" in pages
    assert [page for page in pages if not page_html(site, page).is_file()] == []


@pytest.mark.parametrize("name", ["README.md", "BENCHMARKS.md"])
def test_links_of_the_front_pages_resolve_to_files_and_anchors(site, name):
    text = (ROOT / name).read_text(encoding="utf-8")
    assert "](docs/" in text, f"{name} links to no page of docs/"
    assert broken_links(text, site) == []


def test_the_readme_is_a_front_page_with_the_two_commands():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= MAX_README_LINES, "move the detail to a page of docs/ and link to it"
    assert "## Fresh machine: two commands\n\n```bash title=\"CPU\"\n" + TWO_COMMANDS + "```\n" in text


def test_the_link_checker_reports_a_missing_file_and_a_missing_anchor(site):
    text = ("[ok](docs/training.md#deepspeed) [gone](docs/nope.md) [anchor](docs/training.md#nope) "
            "[web](https://example.org/x.md) [here](#local)")
    assert broken_links(text, site) == ["docs/nope.md: no file docs/nope.md",
                                        "docs/training.md#nope: no anchor #nope in docs/training.md"]


def small_site(folder: Path, pages: dict[str, str]) -> Path:
    """A mkdocs.yml in ``folder`` with the repository's settings (theme, plugins, extensions, validation) and these
    pages (``{"index.md": "# Home"}``), written under ``folder/docs``; the stylesheet is the repository's."""
    (folder / "docs" / "stylesheets").mkdir(parents=True)
    shutil.copy(ROOT / "docs" / "stylesheets" / "extra.css", folder / "docs" / "stylesheets")
    for name, text in pages.items():
        (folder / "docs" / name).write_text(text)
    nav = "".join(f"  - {name}\n" for name in pages)
    config = folder / "mkdocs.yml"
    config.write_text(f"INHERIT: {ROOT / 'mkdocs.yml'}\ndocs_dir: docs\nnav:\n{nav}")
    return config


def test_a_broken_anchor_between_pages_fails_the_strict_build(tmp_path):
    config = small_site(tmp_path, {"index.md": "# Home\n\n[other](other.md#missing)\n", "other.md": "# Other\n"})
    with pytest.raises(Abort):
        build_docs_site(config, tmp_path / "site")


def test_a_fence_title_renders_as_the_blocks_title_bar(tmp_path):
    config = small_site(tmp_path, {"index.md": '# Home\n\n```bash title="GPU"\nmake test\n```\n'})
    build_docs_site(config, tmp_path / "site")
    html = (tmp_path / "site" / "index.html").read_text(encoding="utf-8")
    assert '<span class="filename">GPU</span>' in html
    assert 'title="GPU"' not in html, "the fence's title was printed as text: mkdocs.yml needs pymdownx.superfences"
