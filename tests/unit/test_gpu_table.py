"""bench/gpu/table.py: the GPU table of docs/benchmarks/gpu.md comes from the committed GPU results, never by hand;
a dry run's record is refused; each stage's row is the latest GPU run's that measured it."""

from __future__ import annotations

import copy
import json
import sys

from helpers import ROOT

sys.path.insert(0, str(ROOT / "bench" / "gpu"))
import table  # noqa: E402

RESULTS = sorted((ROOT / "bench" / "gpu" / "results").glob("*.json"))


def test_the_page_holds_the_table_the_committed_results_give(capsys):
    assert RESULTS, "bench/gpu/results holds no GPU run"
    assert table.main(["--check"]) == 0, capsys.readouterr().err


def test_every_measured_figure_of_the_results_is_in_the_page():
    page = (ROOT / "docs" / "benchmarks" / "gpu.md").read_text()
    for row, _ in table.latest_rows(table.load_runs(RESULTS)).values():
        assert table._cell(table.figure(row)) in page, row["stage"]


def test_a_cell_shows_no_python_reprs_and_the_table_stays_narrow():
    text = table.render(table.load_runs(RESULTS))
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    assert rows and all(line.count(" | ") == 3 for line in rows)  # four columns: stage, figure, target, GPU (run)
    assert "{" not in text and "'" not in "".join(rows)  # no dict or string repr in a cell
    syncs = next(line for line in rows if line.startswith("| `host_syncs`"))
    assert "`__bool__` 3" in syncs and "`item` 1" in syncs  # the kinds in code spans: never bold "bool"


def test_an_edited_table_is_caught(tmp_path, capsys):
    page = tmp_path / "gpu.md"
    page.write_text((ROOT / "docs" / "benchmarks" / "gpu.md").read_text().replace("MFU 28.5%", "MFU 45.5%"))
    assert table.main(["--check", "--page", str(page)]) == 1
    assert "table.py --write" in capsys.readouterr().err
    assert table.main(["--write", "--page", str(page)]) == 0 and table.main(["--check", "--page", str(page)]) == 0


def test_a_dry_run_record_is_refused(tmp_path, capsys):
    record = json.loads(RESULTS[0].read_text())
    (tmp_path / "dry.json").write_text(json.dumps({**record, "mode": "dry run (CPU, tiny recipe: not GPU figures)"}))
    assert table.main(["--results", str(tmp_path)]) == 2
    assert "not a GPU run" in capsys.readouterr().err


def test_each_stage_takes_the_latest_run_that_measured_it():
    first = json.loads(RESULTS[0].read_text())
    later = copy.deepcopy(first)
    later["started"] = "2099-01-01T00:00:00+00:00"
    mfu = next(row for row in later["stages"] if row["stage"] == "mfu_zero2")
    mfu["figure"] = "later figure"
    fp8 = next(row for row in later["stages"] if row["stage"] == "fp8")
    fp8.update(status="failed: worker stopped", figure="")
    rows = table.latest_rows([{**first, "file": "a.json"}, {**later, "file": "b.json"}])
    assert rows["mfu_zero2"][0]["figure"] == "later figure" and rows["mfu_zero2"][1]["file"] == "b.json"
    assert rows["fp8"][1]["file"] == "a.json"  # a failed row does not hide the measured one


def test_unmeasured_stages_say_so():
    text = table.render([])
    assert "| `levers` | not measured |" in text and "The levers, one by one: not measured yet." in text


def _window(tokens_per_sec, mfu, diff, **levers):
    return {"tokens_per_sec": tokens_per_sec, "mfu": mfu, "step_peak_gib": 30.0, "held_loss_diff": diff,
            "levers": levers}


def test_the_ladder_gives_each_lever_s_gain_over_the_baseline_from_the_results(tmp_path, capsys):
    record = json.loads(RESULTS[0].read_text())
    levers = {"windows": {"baseline": _window(34000.0, 0.285, 0.0), "full logits": _window(35700.0, 0.299, 2e-3),
                          "liger": _window(40800.0, 0.342, -4e-3), "compile": {"error": "RuntimeError: a | b"}},
              "skipped": {"varlen": "not available in this build", "fp8 compiled": "not measured (its own build)"},
              "profile": {"baseline": {"timed": "GPU kernels", "ms": {"matmuls": 600.0, "attention": 90.0, "loss": 1234.5}}}}
    levers_row = {"stage": "levers", "what": "", "target": ">= 45% MFU", "status": "measured",
                  "sides": {"levers": levers, "no DeepSpeed": {"tokens_per_sec": 17000.0}}}
    record.update(started="2099-01-01T00:00:00+00:00", stages=[levers_row])
    (tmp_path / "levers.json").write_text(json.dumps(record))
    assert table.main(["--results", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "| liger | 40,800 | 34.2% | 1.200x | 30.0 | -4.0e-03 |" in text
    assert "| full logits | 35,700 | 29.9% | 1.050x | 30.0 | +2.0e-03 |" in text
    assert "| compile | failed: RuntimeError: a \\| b | | | | |" in text
    assert "| varlen | not measured: not available in this build | | | | |" in text
    assert "| fp8 compiled | not measured (its own build) | | | | |" in text  # said once
    assert "Profile of one step, baseline (GPU kernels, ms): matmuls 600, attention 90, loss 1,234." in text
    assert "best (liger) 40,800 tokens/s, MFU 34.2%, 1.200x; no DeepSpeed 0.500x the baseline" in text
