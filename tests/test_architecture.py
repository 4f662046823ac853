"""The package's layering, as drawn in README.md ("Architecture"): a module imports only from lower layers.

Imports are read from the source (function-level ones included), so a lazy import that bends the layering
fails here as surely as a top-level one. Strict layering also rules out import cycles.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from conftest import ROOT

PACKAGE = ROOT / "lmrecipe"

# Lower number = lower layer. Keep in step with the README's Architecture section.
LAYERS = {
    # foundation: no knowledge of training
    "errors": 0, "fileio": 0, "metrics": 0, "determinism": 0,
    "cli": 1, "config": 1, "runlock": 1,
    # components: each one concern, unaware of the loop
    "data": 2, "model": 2, "optim": 2, "tracking": 2, "plots": 2, "launch": 2, "profiling": 2,
    "distributed": 3, "loss": 3, "prepare": 3, "mixture": 3, "report": 3, "portable": 3, "ema": 3,
    "background_save": 3,
    "checkpoint": 4, "memory": 4, "reporting": 4,
    "export": 5, "oom": 5, "spikes": 5,
    "evaluate": 6,
    # orchestration: the loop and the comparison driver
    "trainer": 7, "compare": 7,
}


def package_imports(path: Path) -> set[str]:
    """Modules of the package that ``path`` imports, anywhere in the file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1 and node.module:
                found.add(node.module.split(".")[0])
            elif node.level == 1:
                found.update(alias.name for alias in node.names)
            elif node.module and node.module.split(".")[0] == "lmrecipe":
                parts = node.module.split(".")
                found.update([parts[1]] if len(parts) > 1 else [alias.name for alias in node.names])
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[1] for a in node.names if a.name.startswith("lmrecipe."))
    return found


def modules() -> list[str]:
    return sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__")


def test_every_module_has_a_layer():
    missing = [m for m in modules() if m not in LAYERS]
    assert not missing, f"place {missing} in LAYERS (and in the README's Architecture section)"
    assert not [m for m in LAYERS if m not in modules()], "LAYERS names a module that no longer exists"


@pytest.mark.parametrize("module", modules())
def test_imports_point_down(module):
    upward = sorted(dep for dep in package_imports(PACKAGE / f"{module}.py")
                    if dep in LAYERS and LAYERS[dep] >= LAYERS.get(module, -1) and dep != module)
    assert not upward, f"lmrecipe.{module} (layer {LAYERS[module]}) imports {upward} from its own or a higher layer"


def test_the_checker_sees_lazy_and_absolute_imports(tmp_path):
    source = tmp_path / "sample.py"
    source.write_text("def f():\n    from .trainer import train\n    from lmrecipe.export import x\n    import lmrecipe.loss\n")
    assert package_imports(source) == {"trainer", "export", "loss"}


def test_package_modules_do_not_print_or_read_argv():
    offenders = []
    for module in modules():
        if module == "cli":  # the one place that prints: a user error's message on stderr
            continue
        for node in ast.walk(ast.parse((PACKAGE / f"{module}.py").read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "print":
                offenders.append(f"{module}:{node.lineno} print")
            if isinstance(node, ast.Attribute) and node.attr == "argv":
                offenders.append(f"{module}:{node.lineno} sys.argv")
    assert not offenders, offenders
