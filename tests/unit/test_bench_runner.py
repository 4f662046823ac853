"""bench/run.py, the benchmarks' runner, in this process: it lists every case of bench/cases/ with its summary, and an
unknown case exits 2 naming it and the cases, before anything is imported, measured or written."""

from __future__ import annotations

import importlib.util
import re

from helpers import ROOT


def test_the_runner_lists_every_case_and_refuses_an_unknown_one(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))  # as Python does for the script: _common and cases/ beside it
    spec = importlib.util.spec_from_file_location("bench_runner", ROOT / "bench" / "run.py")
    runner = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(runner)
    cases = sorted(p.stem for p in (ROOT / "bench" / "cases").glob("*.py") if p.stem != "__init__")
    assert len(cases) >= 15
    assert runner.main([]) == 0
    listing = capsys.readouterr().out.splitlines()
    for case in cases:
        line = next((line for line in listing if line.split()[:1] == [case]), None)
        assert line is not None and len(line.split()) > 3, f"{case} is not listed with its summary"
    assert runner.main(["loop_overheads", "--pairs", "1"]) == 2
    err = capsys.readouterr().err
    assert "no case named 'loop_overheads'" in err and "loop_overhead," in err and "Traceback" not in err


def test_every_benchmark_the_docs_name_is_a_case():
    cases = {p.stem for p in (ROOT / "bench" / "cases").glob("*.py")}
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    named = {(page.relative_to(ROOT).as_posix(), name) for page in pages
             for name in re.findall(r"bench/run\.py ([a-z_]+)", page.read_text())}
    assert named, "no page names a benchmark: the pattern no longer matches the docs"
    assert not [f"{page}: {name}" for page, name in sorted(named) if name not in cases]
