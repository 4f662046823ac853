"""Multiple-choice tasks in the loop (live ZeRO-3 model, 2 processes) against eval.py's scorer, and eval.py's refusal
of a bad task file."""

from __future__ import annotations

import pytest
from helpers import STEPS, TASK_ITEMS, run_script, zero_pair

from lmrecipe.checkpoint.storage import step_dir_name
from lmrecipe.observe.metrics_log import read_metrics


@pytest.mark.slow
def test_tasks_scored_live_under_zero3_on_2_processes_equal_one_process_on_the_checkpoint(tmp_path_factory, tiny_data):
    from lmrecipe.evaluation.evaluate import evaluate_tasks

    run = zero_pair(tmp_path_factory, tiny_data, 3)["a"]
    rows = [r for r in read_metrics(run / "metrics.jsonl") if "acc/next_line" in r]
    assert [r["step"] for r in rows] == [STEPS] and rows[0]["chance/next_line"] == 0.25
    # In this process, on the checkpoint saved at the same step: other batches, no document-masking attention.
    offline, is_main = evaluate_tasks(run / "checkpoints" / step_dir_name(STEPS), ["next_line"], tiny_data,
                                      batch_size=5, next_line_items=TASK_ITEMS)
    print(f"next_line: live (ZeRO-3, 2 processes) acc {rows[0]['acc/next_line']:.4f} acc_norm "
          f"{rows[0]['acc_norm/next_line']:.4f}; checkpoint, 1 process {offline['next_line']}")
    assert is_main and offline["next_line"]["items"] == TASK_ITEMS
    assert offline["next_line"]["acc"] == pytest.approx(rows[0]["acc/next_line"], abs=1e-9)
    assert offline["next_line"]["acc_norm"] == pytest.approx(rows[0]["acc_norm/next_line"], abs=1e-9)
    assert "## Tasks (multiple choice, log-likelihood)" in (run / "report.md").read_text()
    assert (run / "training.png").stat().st_size > 0


@pytest.mark.slow
def test_eval_py_refuses_a_bad_task_file_naming_its_line(tmp_path, tmp_path_factory, tiny_data):
    bad = tmp_path / "quiz.jsonl"
    bad.write_text('{"context": "1 + 1 =", "choices": [" 2", " 3"], "gold": 0}\n{"context": "x", "choices": ["a"], '
                   '"gold": 0}\n')
    checkpoint = zero_pair(tmp_path_factory, tiny_data, 3)["a"] / "checkpoints" / step_dir_name(STEPS)
    proc = run_script(["eval.py", str(checkpoint), "--tasks", "next_line", str(bad), "--data", str(tiny_data)],
                      check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"{bad}, line 2" in proc.stderr and "at least two strings" in proc.stderr
