"""The goodput account from ``goodput.json``'s sessions: a resume's repeated steps and restart, a rollback's
discarded steps, a fresh start dropping the earlier sessions, and the report's section."""

from __future__ import annotations

import pytest

from lmrecipe.observe.goodput import SessionLedger, read_sessions, report_lines, summarize


def session(started_at, start_step, updated_at, steps_s, saved, **seconds) -> dict:
    ledger = SessionLedger(start_step, started_at)
    ledger.entry.update(updated_at=updated_at, steps_s=steps_s, saved={str(k): v for k, v in saved.items()}, **seconds)
    return ledger.entry


def test_a_resume_repeats_the_steps_after_its_checkpoint_and_the_gap_is_a_restart():
    # Session 1: 10 s of start-up, 60 s of steps (40 s of them by the checkpoint of step 20), last record at t=100;
    # it died, and session 2 started at t=130 from step 20, trained 50 s of steps and ended at t=200.
    first = session(0.0, 0, 100.0, 60.0, {0: 0.0, 20: 40.0}, startup_s=10.0, checkpoint_s=5.0, eval_s=4.0,
                    data_wait_s=2.0)
    second = session(130.0, 20, 200.0, 50.0, {20: 0.0}, startup_s=12.0, data_wait_s=1.0)
    account = summarize([first, second])
    assert account["wall_s"] == 200.0 and account["sessions"] == 2
    assert account["repeated_s"] == 20.0 and account["restart_s"] == 30.0
    assert account["productive_s"] == (60.0 - 20.0 - 2.0) + (50.0 - 1.0)
    assert account["startup_s"] == 22.0 and account["checkpoint_s"] == 5.0 and account["eval_s"] == 4.0
    assert sum(v for k, v in account.items() if k.endswith("_s") and k != "wall_s") == pytest.approx(200.0)
    assert account["goodput"] == pytest.approx(87.0 / 200.0)


def test_a_resume_from_before_every_checkpoint_of_a_session_repeats_all_of_it():
    first = session(0.0, 0, 50.0, 30.0, {0: 0.0})
    second = session(60.0, 0, 100.0, 30.0, {0: 0.0})
    assert summarize([first, second])["repeated_s"] == 30.0


def test_a_rollback_discards_the_steps_since_its_checkpoint():
    ledger = SessionLedger(0, 0.0)
    for step in range(1, 11):
        ledger.step_done(step, 1.0, 0.0)
        if step == 4:
            ledger.saved(4)
    ledger.rolled_back(4)  # steps 5-10: 6 s
    for step in range(5, 11):
        ledger.step_done(step, 1.0, 0.0)
    ledger.entry["updated_at"] = 20.0
    account = summarize([ledger.entry])
    assert ledger.entry["rolled_back_s"] == 6.0 and account["repeated_s"] == 6.0 and account["productive_s"] == 10.0


def test_the_ledger_keeps_the_earlier_sessions_and_a_fresh_start_drops_them(tmp_path):
    first = SessionLedger(0, 1.0)
    first.write(tmp_path)
    first.write(tmp_path)  # rewritten in place
    resumed = SessionLedger(20, 2.0)
    resumed.write(tmp_path)
    assert [s["start_step"] for s in read_sessions(tmp_path)] == [0, 20]
    SessionLedger(0, 3.0).write(tmp_path)
    assert [s["started_at"] for s in read_sessions(tmp_path)] == [3.0]


def test_the_report_section_lists_every_category(tmp_path):
    assert report_lines(tmp_path, []) == []  # no goodput.json
    ledger = SessionLedger(0, 0.0)
    ledger.step_done(1, 3.0, 0.5)
    ledger.write(tmp_path)
    lines = report_lines(tmp_path, [])
    assert lines[0] == "## Goodput" and sum(line.startswith("| ") for line in lines) == 2 + 8  # header, rule, the categories
    assert not any("slowest rank" in line for line in lines)


def test_the_wait_for_the_slowest_rank_counts_every_step_of_each_interval(tmp_path):
    rows = [{"step": 1, "loss": 1.0, "compute_s_median": 1.0, "compute_s_max": 1.5, "interval_steps": 1},
            {"step": 5, "loss": 1.0, "compute_s_median": 1.0, "compute_s_max": 2.0, "interval_steps": 4},
            {"step": 5, "val_loss": 1.0}]
    SessionLedger(0, 0.0).write(tmp_path)
    assert any("took 4.5 s more than the median" in line for line in report_lines(tmp_path, rows))


def test_a_goodput_file_that_cannot_be_written_costs_a_warning_not_the_run(tmp_path, caplog):
    """A full or failing disk at the end (the run's own error on its way out) leaves the account unwritten, with a
    warning: the write raises nothing that would replace the error that ends the run."""
    from types import SimpleNamespace

    from lmrecipe.train.callbacks.goodput import GoodputLedger

    blocked = tmp_path / "a_file"
    blocked.write_text("")  # out_dir below a file: every write fails with an OSError
    callback = GoodputLedger()
    callback.attach(SimpleNamespace(out_dir=blocked / "run", run=SimpleNamespace(
        cfg=SimpleNamespace(logging=None), accelerator=SimpleNamespace(is_main_process=True))))
    callback.before_step(SimpleNamespace(state=SimpleNamespace(step=0)))
    with caplog.at_level("WARNING"):
        callback.on_close(None)
    assert "goodput.json not updated" in caplog.text
