"""The documentation: the site builds with ``mkdocs build --strict``, and README.md stays a front page.

mkdocs.yml's ``validation`` makes a link to a missing page, a missing ``#anchor`` and an unrecognised link warnings,
and ``strict`` turns any warning into a failed build, so the build itself checks every link between pages. The
README and BENCHMARKS.md live outside ``docs/``: their links into it are checked here against the built site (a
file, and an anchor the page really has).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from helpers import ROOT
from mkdocs.commands.build import build
from mkdocs.config import load_config
from mkdocs.exceptions import Abort

MAX_README_LINES = 200
"""The README is the front page: what, two commands, a quick start, links. The manual is docs/."""

TWO_COMMANDS = ("make demo   # creates .venv, installs, prepares the embedded corpus, trains recipes/tiny.yaml, "
                "evaluates the export\n"
                "make test   # creates .venv, installs, runs the test suite\n")
"""The README's fresh-machine block, as CI (.ci/run) runs it."""

_LINK = re.compile(r"\]\(([^)\s]+)\)")


def build_site(config_file: Path, site_dir: Path) -> None:
    """``mkdocs build --strict`` of ``config_file`` into ``site_dir``; raises Abort on any warning."""
    build(load_config(str(config_file), strict=True, site_dir=str(site_dir)))


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    build_site(ROOT / "mkdocs.yml", out)
    return out


def page_html(site: Path, page: str) -> Path:
    """The built HTML of a page of docs/ (``benchmarks/index.md`` -> ``benchmarks/index.html``)."""
    stem = page[: -len(".md")]
    return site / (stem + ".html" if stem == "index" or stem.endswith("/index") else stem + "/index.html")


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
    assert "## Fresh machine: two commands\n\n```bash\n" + TWO_COMMANDS + "```\n" in text


def test_the_link_checker_reports_a_missing_file_and_a_missing_anchor(site):
    text = ("[ok](docs/training.md#deepspeed) [gone](docs/nope.md) [anchor](docs/training.md#nope) "
            "[web](https://example.org/x.md) [here](#local)")
    assert broken_links(text, site) == ["docs/nope.md: no file docs/nope.md",
                                        "docs/training.md#nope: no anchor #nope in docs/training.md"]


def test_a_broken_anchor_between_pages_fails_the_strict_build(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "index.md").write_text("# Home\n\n[other](other.md#missing)\n")
    (tmp_path / "docs" / "other.md").write_text("# Other\n")
    config = tmp_path / "mkdocs.yml"
    # The repository's settings (theme, validation), with this folder's pages.
    config.write_text(f"INHERIT: {ROOT / 'mkdocs.yml'}\ndocs_dir: docs\nnav:\n  - index.md\n  - other.md\n")
    with pytest.raises(Abort):
        build_site(config, tmp_path / "site")
