"""Every repository path that the docs, the build and container files and the code's comments name exists.

A mention is a token that starts with one of the checkout's top-level entries (``lmrecipe/``, ``tests/``,
``train.py``, ``Makefile``, ...) and does not follow ``/`` or ``$``: ``/opt/lmrecipe/train.py`` is a path inside
the image, ``$PWD/data`` one on the user's machine. A glob (``recipes/*.yaml``) must match something; ``{...}`` and
``<...>`` placeholders match like ``*``; a ``:NAME`` or ``::test`` suffix names a thing inside the file, so the file
is checked. In Python files only comments and docstrings are read: a string in code may name a missing path on
purpose (a test of the error it raises).
"""

from __future__ import annotations

import ast
import glob
import os
import re
from fnmatch import fnmatch
from pathlib import Path

import pytest
from helpers import ROOT

# The files read, as patterns of their path in the repository (``*`` crosses folders).
READ = ("*.md", "*.py", "Dockerfile", "Makefile", "pyproject.toml", "containers/*", "slurm/*", ".ci/*")

# Exclusions, each with its reason:
# - what .gitignore names (.venv/, runs/, data/, out/, ...) is made by installs and runs: it is neither a top-level
#   entry whose mentions are checked nor a folder that is read;
# - torch.profiler region names look like package paths (lmrecipe/observe/profiler.py: PREFIX + the section);
PROFILER_REGIONS = {"lmrecipe/step", "lmrecipe/data", "lmrecipe/forward", "lmrecipe/backward", "lmrecipe/optimizer"}
# - a path after an option that writes it names what the command creates (``--write-recipe recipes/planned.yaml``).
OUTPUT_OPTIONS = ("--write-recipe", "--output", "--out")

_PLACEHOLDER = re.compile(r"\{[^{}\s]*\}|<[\w-]+>")
_OUTPUT_BEFORE = re.compile(r"(?:%s)[ =]$" % "|".join(map(re.escape, OUTPUT_OPTIONS)))


def ignore_patterns(root: Path) -> list[str]:
    """The patterns of ``root/.gitignore`` (the plain ones this repository uses: no negation)."""
    lines = (root / ".gitignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith(("#", "!"))]


def is_ignored(rel: str, patterns: list[str]) -> bool:
    """Whether the file or folder at ``rel`` (relative to the root) is ignored: ``/x/`` only at the top, ``x/`` anywhere."""
    name = rel.rsplit("/", 1)[-1]
    return any(fnmatch(rel if p.startswith("/") else name, p.strip("/")) for p in patterns)


def top_level_entries(root: Path) -> list[str]:
    """The checkout's top-level files and folders, but ``.git`` and what .gitignore names."""
    patterns = ignore_patterns(root)
    return sorted(e for e in os.listdir(root) if e != ".git" and not is_ignored(e, patterns))


def mention_pattern(root: Path, entries: list[str]) -> re.Pattern:
    """A token that starts with a top-level entry: a folder followed by ``/``, a file as a whole word."""
    starts = [re.escape(e) + ("/" if (root / e).is_dir() else r"(?![\w.-])") for e in entries]
    return re.compile(r"(?<![\w./$-])(?:%s)(?:[\w./*:-]|\{[^{}\s]*\}|<[\w-]+>)*" % "|".join(starts))


def files_to_read(root: Path) -> list[str]:
    """The files :data:`READ` selects, relative to ``root``; ignored folders are not walked."""
    patterns = ignore_patterns(root)
    found = []
    for folder, dirs, files in os.walk(root):
        base = Path(folder).relative_to(root).as_posix()
        base = "" if base == "." else base + "/"
        dirs[:] = [d for d in dirs if d != ".git" and not is_ignored(base + d, patterns)]
        found += [base + f for f in files if not is_ignored(base + f, patterns) and any(fnmatch(base + f, p) for p in READ)]
    return sorted(found)


def code_string_spans(source: str) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """(start, end) of every string literal in code, as (line, byte column): all but the bare string statements
    (docstrings, and the attribute docstrings under dataclass fields)."""
    tree = ast.parse(source)
    prose = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    return [((n.lineno, n.col_offset), (n.end_lineno, n.end_col_offset)) for n in ast.walk(tree)
            if (isinstance(n, ast.JoinedStr) or isinstance(n, ast.Constant) and isinstance(n.value, str))
            and id(n) not in prose]


def mentions(text: str, pattern: re.Pattern, python: bool = False) -> list[tuple[int, str]]:
    """(line, token) of every mention in ``text``; in Python source, only those in comments and docstrings."""
    found = []
    spans = None
    for number, line in enumerate(text.splitlines(), 1):
        for match in pattern.finditer(line):
            if python:
                spans = code_string_spans(text) if spans is None else spans
                at = (number, len(line[:match.start()].encode()))
                if any(start <= at < end for start, end in spans):
                    continue
            if _OUTPUT_BEFORE.search(line[:match.start()]):
                continue
            found.append((number, match.group()))
    return found


def target(token: str) -> str | None:
    """The path a token names (suffixes, trailing punctuation and placeholders dealt with); None when not a path."""
    path = token.split(":", 1)[0].rstrip(".,;")
    if path in PROFILER_REGIONS:
        return None
    return _PLACEHOLDER.sub("*", path)


def exists(root: Path, path: str) -> bool:
    if any(char in path for char in "*?["):
        return bool(glob.glob(str(root / path)))
    return (root / path).exists()


def missing_paths(root: Path) -> list[str]:
    """``file:line: path`` for every mention of a path that does not exist."""
    pattern = mention_pattern(root, top_level_entries(root))
    missing = []
    for rel in files_to_read(root):
        for number, token in mentions((root / rel).read_text(encoding="utf-8"), pattern, rel.endswith(".py")):
            path = target(token)
            if path is not None and not exists(root, path):
                missing.append(f"{rel}:{number}: {path}")
    return missing


def test_every_named_repository_path_exists():
    missing = missing_paths(ROOT)
    assert not missing, f"{len(missing)} mentions of paths that do not exist:\n" + "\n".join(missing)


def test_the_scan_reads_the_docs_the_build_files_and_the_code_but_not_what_runs_make():
    read = files_to_read(ROOT)
    assert {"README.md", "tests/README.md", "Dockerfile", "Makefile", "containers/lmrecipe.def", ".ci/run",
            "slurm/launch.sh", "train.py", "tests/unit/test_paths.py", "docs/architecture.md",
            "docs/benchmarks/index.md"} <= set(read)
    assert len([rel for rel in read if rel.startswith("docs/")]) == len(list((ROOT / "docs").rglob("*.md")))
    assert not [rel for rel in read if rel.startswith((".venv/", "runs/", "data/"))]
    pattern = mention_pattern(ROOT, top_level_entries(ROOT))
    assert "recipes/tiny.yaml" in {token for _, token in mentions((ROOT / "Makefile").read_text(), pattern)}


@pytest.fixture
def sample_repo(tmp_path) -> Path:
    for rel in ("pkg/a.py", "pkg/b.yaml", "tool.py", "docs/x.md"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    (tmp_path / ".gitignore").write_text("/runs/\n.venv/\n")
    (tmp_path / "runs").mkdir()
    return tmp_path


def test_a_mention_is_a_token_that_starts_with_a_top_level_entry(sample_repo):
    entries = top_level_entries(sample_repo)
    assert entries == [".gitignore", "docs", "pkg", "tool.py"]
    pattern = mention_pattern(sample_repo, entries)
    text = ("see `pkg/a.py:12`, pkg/a.py::test_x and pkg/*.yaml.\n"
            "not /opt/pkg/c.py, $PWD/pkg/d.py, runs/e.py, my_tool.py, pkgs/f.py; but tool.py and pkg/{name}.py\n"
            "tool.py --write-recipe pkg/new.yaml\n")
    assert mentions(text, pattern) == [(1, "pkg/a.py:12"), (1, "pkg/a.py::test_x"), (1, "pkg/*.yaml."),
                                       (2, "tool.py"), (2, "pkg/{name}.py"), (3, "tool.py")]
    assert [target(t) for _, t in mentions(text, pattern)] == ["pkg/a.py", "pkg/a.py", "pkg/*.yaml", "tool.py",
                                                                "pkg/*.py", "tool.py"]


def test_python_is_read_in_comments_and_docstrings_only(sample_repo):
    pattern = mention_pattern(sample_repo, top_level_entries(sample_repo))
    source = ('"""Reads pkg/gone.py."""\n'
              'import os  # pkg/old.py\n'
              'PATH = "pkg/missing_on_purpose.py"\n'
              'NAME = f"pkg/{os.sep}"\n'
              'LIMIT = 3\n'
              '"""The limit, from pkg/b.yaml."""\n')
    assert mentions(source, pattern, python=True) == [(1, "pkg/gone.py."), (2, "pkg/old.py"), (6, "pkg/b.yaml.")]


def test_a_missing_path_is_reported_with_the_file_and_line_that_name_it(sample_repo):
    (sample_repo / "docs" / "x.md").write_text("ok: pkg/a.py\nstale: pkg/moved.py and tool.py\n")
    (sample_repo / "pkg" / "a.py").write_text("# a comment naming docs/y.md\n")
    (sample_repo / "runs" / "notes.md").write_text("pkg/never_read.py\n")
    assert missing_paths(sample_repo) == ["docs/x.md:2: pkg/moved.py", "pkg/a.py:1: docs/y.md"]
