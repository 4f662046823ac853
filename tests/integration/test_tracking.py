"""Experiment trackers against the real libraries, offline: wandb's offline files, TensorBoard's event files and an
MLflow SQLite store, read back after a run with a loss-spike rollback and a resume, show the steps and values of
``metrics.jsonl``; unknown or missing trackers stop the run before it writes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers import run_train, wandb_runs

from lmrecipe.observe.metrics_log import read_metrics
from lmrecipe.train.callbacks.faults import SPIKE_FAULT_ENV

ROLLBACK = ["schedule.decay=constant", "checkpoint.every_steps=4", "checkpoint.keep_last=5",
            "logging.log_every_steps=3", "train.eval_every_steps=0", "spike.enabled=true", "spike.window=5",
            "spike.min_history=3"]
TRACKERS = "logging.trackers=[wandb,tensorboard,mlflow]"


@pytest.fixture(scope="module")
def tracked(tmp_path_factory, tiny_data) -> Path:
    """10 steps with a spike at step 7 (rolled back from step 8 to 4), then a resume to step 12 (a constant rate,
    which the longer second session keeps)."""
    out = tmp_path_factory.mktemp("tracked") / "run"
    first = run_train(out, tiny_data, ["train.max_steps=10", *ROLLBACK, TRACKERS], env_extra={SPIKE_FAULT_ENV: "7"})
    assert "rolled back to" in first.stderr
    second = run_train(out, tiny_data, ["train.max_steps=12", *ROLLBACK, TRACKERS])
    assert "Resumed from" in second.stderr
    return out


def expected(out: Path) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in read_metrics(out / "metrics.jsonl") if "loss" in row}


def test_tensorboard_shows_one_history(tracked):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tracked / "tensorboard"))
    events.Reload()
    shown = {event.step: event.value for event in events.Scalars("loss")}
    want = expected(tracked)
    assert sorted(shown) == sorted(want) and all(shown[s] == pytest.approx(want[s], rel=1e-6) for s in want)


def test_wandb_continues_the_run_after_the_rollback_and_the_resume(tracked):
    runs = wandb_runs(tracked / "wandb")
    assert len(runs) == 2  # the run before the rollback; the offline run that continues it (and its resume)
    latest = (tracked / "wandb_run_id").read_text().strip()
    [first] = [run_id for run_id in runs if run_id != latest]
    assert runs[latest]["config"]["lmrecipe_continues_run"] == first
    continued_from = min(runs[latest]["history"]) - 1
    shown = {s: row["loss"] for s, row in runs[first]["history"].items() if s <= continued_from}
    shown.update({s: row["loss"] for s, row in runs[latest]["history"].items()})
    want = expected(tracked)
    assert sorted(shown) == sorted(want) and all(shown[s] == pytest.approx(want[s], rel=1e-6) for s in want)


def test_mlflow_continues_the_run_after_the_rollback_and_the_resume(tracked):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tracked / 'mlflow.db'}")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert len(runs) == 2
    latest = client.get_run((tracked / "mlflow_run_id").read_text().strip())
    first = latest.data.tags["lmrecipe.continues_run"]
    later = {m.step: m.value for m in client.get_metric_history(latest.info.run_id, "loss")}
    shown = {m.step: m.value for m in client.get_metric_history(first, "loss") if m.step < min(later)}
    shown.update(later)
    want = expected(tracked)
    assert sorted(shown) == sorted(want) and all(shown[s] == pytest.approx(want[s], rel=1e-6) for s in want)
    assert latest.data.params["optim.lr"] == "0.002"  # the flattened config


@pytest.mark.parametrize("trackers, message", [
    ("[wandb,neptune]", "Choose one of: wandb, tensorboard, mlflow"),
    ("[aim]", "pip install aim"),
])
def test_an_unknown_or_missing_tracker_exits_2_before_writing(tmp_path, tiny_data, trackers, message):
    out = tmp_path / "run"
    proc = run_train(out, tiny_data, ["train.max_steps=2", f"logging.trackers={trackers}"], check=False)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr
    assert not out.exists()


def test_a_run_does_not_inherit_the_test_process_s_wandb_service(tmp_path, tiny_data, monkeypatch):
    """``wandb.login`` with a key starts a wandb service in the calling process and names its socket in
    ``WANDB_SERVICE``; once that service is torn down, a run given the variable would connect to a socket that is gone
    (FileNotFoundError in ``wandb.init``). The suite's runs get the environment of a user's shell, without it."""
    monkeypatch.setenv("WANDB_SERVICE", f"3-{os.getpid()}-unix-{tmp_path / 'gone' / 'socket'}")
    run_train(tmp_path / "run", tiny_data, ["train.max_steps=2", "logging.trackers=[wandb]"])
    assert wandb_runs(tmp_path / "run" / "wandb")
