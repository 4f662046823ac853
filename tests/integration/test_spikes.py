"""Loss spikes: the rule on the device, the skipped-batch order, and real runs that roll back, skip and resume.

A spike is injected with ``LMRECIPE_FAULT_SPIKE_STEPS=N``: the model's logits are multiplied by 1000 whenever its
input is a micro-batch of step N's samples (in the order without skips), so the fault follows the samples, as bad
data does. Its log line says each time it fires: a sample trained on again after the rollback would show.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import run_train

from lmrecipe.checkpoint.storage import read_checkpoint, step_dir_name
from lmrecipe.data.format import TokenWindows
from lmrecipe.data.order import SampleOrder
from lmrecipe.observe.goodput import read_sessions, summarize
from lmrecipe.observe.metrics_log import read_metrics
from lmrecipe.train.callbacks.faults import SPIKE_FAULT_ENV as FAULT_ENV
from lmrecipe.train.callbacks.spikes import read_spikes

SPIKE_STEP = 7
RUN = ["train.max_steps=12", "checkpoint.every_steps=4", "checkpoint.keep_last=5", "logging.log_every_steps=3",
       "train.eval_every_steps=0", "spike.enabled=true", "spike.window=5", "spike.min_history=3"]
INJECTED = "Injecting a loss spike"


# ---------------------------------------------------------------------------------------------- one process


def train_rows(out: Path) -> list[dict]:
    return [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_data) -> dict:
    """``clean``: no fault. ``spiked``: step 7's samples spike, detected at step 8 (a save point), rolled back to
    step 4. ``resumed``: a new run folder resuming from spiked's step 8, the fault still armed."""
    root = tmp_path_factory.mktemp("spikes")
    clean = run_train(root / "clean", tiny_data, RUN)
    spiked = run_train(root / "spiked", tiny_data, RUN, env_extra={FAULT_ENV: str(SPIKE_STEP)})
    source = root / "spiked" / "checkpoints" / step_dir_name(8)
    resumed = run_train(root / "resumed", tiny_data, [*RUN, f"checkpoint.resume={source}"],
                        env_extra={FAULT_ENV: str(SPIKE_STEP)})
    return {"root": root, "clean": clean, "spiked": spiked, "resumed": resumed}


@pytest.mark.slow
def test_spike_is_rolled_back_and_its_samples_never_trained_again(runs, tiny_data):
    out = runs["root"] / "spiked"
    assert runs["spiked"].stderr.count(INJECTED) == 2  # both micro-batches of step 7, once: never fed again
    [record] = read_spikes(out)
    assert record["step"] == SPIKE_STEP and record["detected_at_step"] == 8
    assert record["rolled_back_to"] == 4 and record["checkpoint"].endswith(step_dir_name(4)) and record["rollback"] == 1
    [flag] = record["flagged"]
    assert flag["step"] == SPIKE_STEP and flag["loss"] > 100 and flag["loss_z"] > 6
    assert flag["window_loss_mean"] < 10 and flag["window_loss_std"] > 0
    [skip] = record["skipped"]
    assert skip["data_step"] == SPIKE_STEP - 1 and skip["samples"] == [48, 56]
    order = SampleOrder(len(TokenWindows(tiny_data, "train", 32)), seed=1337)
    assert skip["windows"] == order.windows(48, 8).tolist()
    saved = read_checkpoint(out / "checkpoints" / step_dir_name(12))
    assert saved["extras"]["spikes"]["skipped_batches"] == [SPIKE_STEP - 1] and saved["extras"]["spikes"]["rollbacks"] == 1
    assert saved["data"]["next_sample"] == 13 * 8  # 12 steps trained, one data step skipped
    assert json.loads((out / "final.json").read_text())["rollbacks"] == 1
    [session] = read_sessions(out)  # the goodput ledger: steps 5-7 ran twice (step 8 was discarded at its sync point)
    assert 0 < session["rolled_back_s"] < session["steps_s"] and summarize([session])["repeated_s"] == session["rolled_back_s"]


@pytest.mark.slow
def test_metrics_keep_one_history_that_forks_at_the_spike(runs):
    spiked, clean = train_rows(runs["root"] / "spiked"), train_rows(runs["root"] / "clean")
    assert [r["step"] for r in spiked] == [1, 3, 6, 9, 12]  # step 6 was logged, dropped at the rollback, logged again
    assert [r["loss"] for r in spiked[:3]] == [r["loss"] for r in clean[:3]]  # before the spike: the same run
    assert spiked[3]["loss"] != clean[3]["loss"]  # after it, other samples
    assert all(r["loss"] < 10 for r in spiked)
    assert not read_spikes(runs["root"] / "clean")


@pytest.mark.slow
def test_a_resume_after_the_rollback_keeps_skipping(runs):
    resumed = train_rows(runs["root"] / "resumed")
    spiked = {r["step"]: r["loss"] for r in train_rows(runs["root"] / "spiked")}
    assert INJECTED not in runs["resumed"].stderr and not read_spikes(runs["root"] / "resumed")
    assert [r["step"] for r in resumed] == [9, 12]
    assert max(abs(r["loss"] - spiked[r["step"]]) for r in resumed) <= 1e-5


def test_too_many_rollbacks_stop_the_run(tmp_path, tiny_data):
    out = tmp_path / "run"
    # Step 10's samples (order without skips) land at step 9 once step 7's are skipped.
    proc = run_train(out, tiny_data, [*RUN, "spike.max_rollbacks=1"], env_extra={FAULT_ENV: "7,10"}, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "spike.max_rollbacks=1" in proc.stderr and "a loss spike at step 9" in proc.stderr
    records = read_spikes(out)
    assert [r["step"] for r in records] == [7, 9] and records[1]["rolled_back_to"] is None


# ---------------------------------------------------------------------------------------------- 2 processes


@pytest.mark.slow
@pytest.mark.parametrize("ds_config", ["null", "zero2", "zero3"])
def test_two_processes_roll_back_together(tmp_path, tiny_data, ds_config):
    out = tmp_path / "run"
    proc = run_train(out, tiny_data, [*RUN, f"distributed.deepspeed_config={ds_config}", "checkpoint.background_save=true"],
                     nproc=2, env_extra={FAULT_ENV: str(SPIKE_STEP)})
    assert proc.stderr.count(INJECTED) == 2  # one micro-batch per rank, once
    assert proc.stderr.count("rolled back to") == 2  # both ranks, at the same step
    [record] = read_spikes(out)
    assert record["step"] == SPIKE_STEP and record["rolled_back_to"] == 4 and record["skipped"][0]["samples"] == [48, 56]
    assert [r["step"] for r in train_rows(out)] == [1, 3, 6, 9, 12]
    saved = read_checkpoint(out / "checkpoints" / step_dir_name(12))
    assert saved["extras"]["spikes"]["skipped_batches"] == [SPIKE_STEP - 1]
    # The step-4 checkpoint the rollback reloaded was written in the background (under DeepSpeed too).
    assert "has no effect" not in proc.stderr
    shutil.rmtree(out / "checkpoints")
