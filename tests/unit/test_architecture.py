"""The package's layering, as drawn in docs/architecture.md: a module imports only from lower layers.

The drawing is the one source: :func:`read_layers` parses it. The package is a tree: top-level modules and folders
(``data/``, ``checkpoint/``, ``train/``, ...), each folder with its own order of modules. An import between two
modules is judged where their paths part: at the top level by :data:`LAYERS`, inside a folder by that folder's entry
in :data:`INNER`. The imported side must be in a strictly lower layer. Imports are read from the source
(function-level ones included), so a lazy import that bends the layering fails here as surely as a top-level one.
Strict layering also rules out import cycles.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from helpers import ROOT

PACKAGE = ROOT / "lmrecipe"
DRAWING = ROOT / "docs" / "architecture.md"
"""The page that holds the drawing: its first fenced block."""

_LINE = re.compile(r"^(?P<indent> *)(?P<layer>\d+) (?P<names>[a-z_]+/?(?:, [a-z_]+/?)*)(?: {2,}.*)?$")


def read_layers(text: str) -> tuple[dict[str, int], dict[str, dict[str, int]]]:
    """(top-level layers, each folder's layers) from the drawing: ``LAYER NAME[, NAME...]  what they hold`` per line;
    a folder (``name/``) is followed by its own modules, indented deeper."""
    block = text.split("```", 2)[1].split("\n", 1)[1]
    top: dict[str, int] = {}
    inner: dict[str, dict[str, int]] = {}
    folders: list[tuple[int, str]] = []  # (indent, dotted folder) of the folders the next lines may belong to
    for number, line in enumerate(block.splitlines(), 1):
        if not line.strip():
            continue
        match = _LINE.match(line)
        assert match, f"line {number} of the Architecture drawing is not 'LAYER NAME[, NAME...]  text': {line!r}"
        indent = len(match["indent"])
        while folders and folders[-1][0] >= indent:
            folders.pop()
        parent = folders[-1][1] if folders else None
        table = top if parent is None else inner.setdefault(parent, {})
        for name in match["names"].split(", "):
            bare = name.rstrip("/")
            assert bare not in table, f"{bare!r} is drawn twice in {parent or 'the package'}"
            table[bare] = int(match["layer"])
            if name.endswith("/"):
                folders.append((indent, bare if parent is None else f"{parent}.{bare}"))
    return top, inner


LAYERS, INNER = read_layers(DRAWING.read_text())
"""Lower number = lower layer."""


def module_names() -> list[str]:
    """Every module of the package as a dotted path below ``lmrecipe`` (``data.format``, ``config``)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts[-1] != "__init__":
            found.append(".".join(parts))
    return found


def _is_module(dotted: str) -> bool:
    path = PACKAGE.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or path.is_dir()


def package_imports(path: Path, module: str = "") -> set[str]:
    """Modules of the package that ``path`` (the module ``module``) imports anywhere in the file, as dotted paths."""
    package = module.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1] + (node.module.split(".") if node.module else [])
            elif node.module and node.module.split(".")[0] == "lmrecipe":
                base = node.module.split(".")[1:]
            else:
                continue
            for alias in node.names:
                candidate = ".".join(base + [alias.name])
                found.add(candidate if _is_module(candidate) or not base else ".".join(base))
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".", 1)[1] for a in node.names if a.name.startswith("lmrecipe."))
    return found


def violation(source: str, target: str) -> str | None:
    """Why ``source`` may not import ``target`` (dotted paths), or None when the import points down."""
    src, dst = source.split("."), target.split(".")
    depth = 0
    while depth < min(len(src), len(dst)) and src[depth] == dst[depth]:
        depth += 1
    if depth == len(dst):
        return f"imports its own folder {target!r} (import the module that defines the name)"
    if depth == len(src):
        return None
    table = LAYERS if depth == 0 else INNER.get(".".join(src[:depth]))
    where = "the package" if depth == 0 else ".".join(src[:depth]) + "/"
    if table is None or src[depth] not in table or dst[depth] not in table:
        return f"{src[depth]!r} or {dst[depth]!r} has no layer in {where}: draw it in docs/architecture.md"
    if table[dst[depth]] >= table[src[depth]]:
        return (f"{src[depth]!r} (layer {table[src[depth]]} of {where}) imports {dst[depth]!r} "
                f"(layer {table[dst[depth]]}), which is not below it")
    return None


def test_every_module_and_folder_has_a_layer():
    missing = []
    for module in module_names():
        parts = module.split(".")
        for depth in range(len(parts)):
            table = LAYERS if depth == 0 else INNER.get(".".join(parts[:depth]), {})
            if parts[depth] not in table:
                missing.append(".".join(parts[: depth + 1]))
    assert not sorted(set(missing)), f"draw {sorted(set(missing))} in the drawing of docs/architecture.md"
    drawn = list(LAYERS) + [f"{folder}.{name}" for folder, table in INNER.items() for name in table]
    assert [name for name in drawn if not _is_module(name)] == [], "the drawing names a module that no longer exists"


@pytest.mark.parametrize("module", module_names())
def test_imports_point_down(module):
    path = PACKAGE.joinpath(*module.split(".")).with_suffix(".py")
    problems = [f"{target}: {why}" for target in sorted(package_imports(path, module))
                if target != module and (why := violation(module, target))]
    assert not problems, f"lmrecipe.{module}: " + "; ".join(problems)


def test_the_checker_sees_lazy_absolute_and_relative_imports(tmp_path):
    source = tmp_path / "sample.py"
    source.write_text("def f():\n    from ..train.loop import train\n    from lmrecipe.export import x\n"
                      "    import lmrecipe.loss\n    from lmrecipe.observe import device\n    from .order import y\n")
    assert package_imports(source, "data.batches") == {"train.loop", "export", "loss", "observe.device", "data.order"}


def test_the_checker_judges_across_and_within_folders():
    assert violation("data.batches", "train.loop") is not None  # up, across folders
    assert violation("train.loop", "data.batches") is None
    assert violation("data.order", "data.batches") is not None  # up, within a folder
    assert violation("data.batches", "data.order") is None
    assert violation("observe.console", "observe.device") is None
    assert violation("checkpoint.storage", "checkpoint") is not None  # a folder's own __init__


def test_package_modules_do_not_print_or_read_argv():
    offenders = []
    for module in module_names():
        if module == "cli":  # the one place that prints: a user error's message on stderr
            continue
        path = PACKAGE.joinpath(*module.split(".")).with_suffix(".py")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "print":
                offenders.append(f"{module}:{node.lineno} print")
            if isinstance(node, ast.Attribute) and node.attr == "argv":
                offenders.append(f"{module}:{node.lineno} sys.argv")
    assert not offenders, offenders


LAUNCHERS = {"subprocess", "run_script", "run_train", "cached_run", "plain_run", "zero_pair", "launch_cmd"}
"""What starts a process: the unit tests use none of it (tests/integration launches the scripts)."""


def test_unit_tests_start_no_process_and_no_test_module_imports_another():
    tests = ROOT / "tests"
    offenders = []
    for path in sorted(tests.rglob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [alias.name for alias in node.names]
            if any(name.split(".")[-1].startswith("test_") for name in names):
                offenders.append(f"{path.relative_to(tests)} imports a test module")
            if path.parent.name == "unit" and LAUNCHERS & {name.split(".")[0] for name in names}:
                offenders.append(f"{path.relative_to(tests)} imports a process launcher")
    assert sorted(p.parent.name for p in tests.rglob("test_*.py")) and not offenders, offenders
    assert {p.parent.name for p in tests.rglob("test_*.py")} == {"unit", "integration"}


def test_the_drawing_reader_nests_folders_by_indentation():
    text = ("## Architecture\n\n```\n2 data/, cli   text\n    1 prepare/\n        0 read, write\n    0 documents\n"
            "0 errors  text  with  spaces\n```\n")
    top, inner = read_layers(text)
    assert top == {"data": 2, "cli": 2, "errors": 0}
    assert inner == {"data": {"prepare": 1, "documents": 0}, "data.prepare": {"read": 0, "write": 0}}
    with pytest.raises(AssertionError, match="not 'LAYER NAME"):
        read_layers("## Architecture\n```\n2 data/ text with one space\n```\n")


MAX_CLASS_LINES = 250
"""A class longer than this usually holds two jobs: name them and split."""


def test_no_class_holds_more_than_a_screenful_of_jobs():
    long = []
    for module in module_names():
        path = PACKAGE.joinpath(*module.split(".")).with_suffix(".py")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                long.append(f"{module}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not long, long


def test_no_script_edits_sys_path():
    """Scripts import the package as it is installed (``pip install -e .``, which ``make`` does); a script that puts
    a folder on ``sys.path`` would shadow the installed package with whatever tree it sits in."""
    scripts = [ROOT / "train.py", ROOT / "eval.py", *(ROOT / "tools").glob("*.py"), *(ROOT / "bench").rglob("*.py")]
    editing = [str(p.relative_to(ROOT)) for p in scripts if "sys.path.insert" in p.read_text() or
               "sys.path.append" in p.read_text()]
    assert len(scripts) > 20 and not editing, editing
