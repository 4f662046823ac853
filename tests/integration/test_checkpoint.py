"""Checkpoints: exact resume (no DeepSpeed, ZeRO-2, ZeRO-3), kill -9 during a save (synchronous or in the background),
background writes equal to synchronous ones, preemption, retention, bad input."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from helpers import (
    HALF,
    LOSS_TOL,
    ROOT,
    STEPS,
    TINY_OVERRIDES,
    assert_layer_norms_add_up,
    cached_run,
    launch_cmd,
    losses,
    max_loss_diff,
    plain_run,
    run_script,
    run_train,
    subprocess_env,
    tree_digest,
    zero_pair,
)

from lmrecipe.checkpoint.storage import (
    EXIT_PREEMPTED,
    LATEST,
    PREEMPTED_MARKER,
    PROBE_FILE,
    STATE_FILE,
    find_resume_checkpoint,
    read_checkpoint,
    step_dir_name,
)
from lmrecipe.errors import UserError
from lmrecipe.observe.metrics_log import read_metrics


def logged_steps_while_running(out_dir: Path) -> list[int]:
    """Steps in metrics.jsonl of a live run (its last line may be half written)."""
    path = out_dir / "metrics.jsonl"
    steps = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "loss" in row:
            steps.append(row["step"])
    return steps


def latest_name(root: Path) -> str:
    return (root / LATEST).read_text().strip()


@pytest.fixture(scope="module")
def plain(tmp_path_factory, tiny_data) -> Path:
    return plain_run(tmp_path_factory, tiny_data)


# ---------------------------------------------------------------------------------------------- one process, no DeepSpeed


def test_keep_last_and_best_in_a_real_run(plain):
    root = plain / "checkpoints"
    vals = {r["step"]: r["val_loss"] for r in read_metrics(plain / "metrics.jsonl") if "val_loss" in r}
    best = min(vals, key=vals.get)
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == sorted({step_dir_name(s) for s in (STEPS - 1, STEPS, best)})
    assert latest_name(root) == step_dir_name(STEPS) and (root / "best").read_text().strip() == step_dir_name(best)
    saved = read_checkpoint(root / step_dir_name(STEPS))
    assert saved["state"]["step"] == STEPS and saved["state"]["tokens_seen"] == STEPS * 8 * 32
    assert saved["data"]["next_sample"] == STEPS * 8 and saved["val_loss"] == pytest.approx(vals[STEPS])
    assert saved["config"]["data"]["seq_len"] == 32
    assert saved["topology"] == {"world_size": 1, "deepspeed": False, "zero_stage": 0, "offload_optimizer": False,
                                 "offload_param": False, "sequence_parallel_size": 1,
                                 "tensor_parallel_size": 1, "expert_parallel_size": 1}
    assert (root / step_dir_name(STEPS) / "rng" / "rank_00000.safetensors").is_file()


KILL_DURING_SECOND_SAVE = """
import os, signal, sys
import accelerate
from lmrecipe.config import load_config
from lmrecipe.train.trainer import train

real_save_state = accelerate.Accelerator.save_state
saves = []

def save_state_then_die(self, *args, **kwargs):
    # The new shards are on disk; the checkpoint is not published yet.
    result = real_save_state(self, *args, **kwargs)
    saves.append(args)
    if len(saves) == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    return result

accelerate.Accelerator.save_state = save_state_then_die
train(load_config("recipes/tiny.yaml", sys.argv[1:]))
"""


@pytest.mark.slow
def test_kill_during_save_keeps_the_previous_checkpoint_and_resume_is_exact(tmp_path, tiny_data, plain):
    out = tmp_path / "run"
    overrides = [f"out_dir={out}", f"data.path={tiny_data}", *TINY_OVERRIDES, f"train.max_steps={STEPS}",
                 f"checkpoint.every_steps={HALF}"]
    killed = run_script(["-c", KILL_DURING_SECOND_SAVE, *overrides], check=False)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    root = out / "checkpoints"
    previous = root / step_dir_name(HALF)
    assert (root / f".tmp_{step_dir_name(STEPS)}").is_dir() and not (root / step_dir_name(STEPS)).exists()
    assert latest_name(root) == previous.name and find_resume_checkpoint("auto", root) == previous
    read_checkpoint(previous)  # complete: every manifest file present with its size
    before = tree_digest(previous)
    assert [step for step, _ in losses(out)] == list(range(1, STEPS + 1))  # logged before the kill hit the save

    resumed = run_train(out, tiny_data, [f"train.max_steps={STEPS}", f"checkpoint.every_steps={HALF}"])  # resume=auto
    assert f"Resumed from {previous}" in resumed.stderr
    # The abandoned continuation's rows (steps 4-6) were dropped and written again by the resumed run: once each.
    assert [step for step, _ in losses(out)] == list(range(1, STEPS + 1))
    new_rows = [(step, loss) for step, loss in losses(out) if step > HALF]
    diff = max_loss_diff(new_rows, losses(plain))
    print(f"no DeepSpeed, 1 process: max |loss difference| after resume = {diff:.3g}")
    assert diff <= LOSS_TOL
    assert latest_name(root) == step_dir_name(STEPS) and not list(root.glob(".tmp_*"))
    assert tree_digest(previous) == before  # the resume never wrote into the checkpoint it read


def test_background_save_writes_what_a_synchronous_save_writes(tmp_path_factory, tiny_data, plain):
    """The plain run again with checkpoint.background_save=true: same losses, same files, export after the last write."""
    out, _ = cached_run(tmp_path_factory, "plain_background", tiny_data, [
        f"train.max_steps={STEPS}", "checkpoint.every_steps=1", "checkpoint.keep_last=2", "train.eval_every_steps=1",
        "checkpoint.export_at_end=true", "checkpoint.export_dtype=fp32", "checkpoint.background_save=true",
    ])
    assert losses(out) == losses(plain)
    for step in (STEPS - 1, STEPS):
        ours, theirs = out / "checkpoints" / step_dir_name(step), plain / "checkpoints" / step_dir_name(step)
        for name in ("model.safetensors", "optimizer.bin", PROBE_FILE):
            assert (ours / name).read_bytes() == (theirs / name).read_bytes(), name
        assert sorted(read_checkpoint(ours)["manifest"]) == sorted(read_checkpoint(theirs)["manifest"])
    assert latest_name(out / "checkpoints") == step_dir_name(STEPS) and not list((out / "checkpoints").glob(".*"))
    assert (out / "export" / "model.safetensors.index.json").is_file() or list((out / "export").glob("*.safetensors"))


KILL_DURING_BACKGROUND_WRITE = """
import json, os, signal, sys, time
from pathlib import Path
from lmrecipe.checkpoint.storage import CheckpointStore
from lmrecipe.config import load_config
from lmrecipe.train.trainer import train

cfg = load_config("recipes/tiny.yaml", sys.argv[1:])
metrics = Path(cfg.out_dir) / "metrics.jsonl"
real_publish = CheckpointStore.publish
publishes = []

def publish_after_the_loop_moved_on(self, tmp, final, record):
    # On the writer thread, every rank's files are in tmp. The loop goes on meanwhile: once it has logged the step
    # after this one, die before the checkpoint is published.
    publishes.append(final)
    if len(publishes) == 2:
        step = record["state"]["step"]
        while not any(json.loads(line)["step"] > step for line in metrics.read_text().splitlines() if line.strip()):
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGKILL)
    return real_publish(self, tmp, final, record)

CheckpointStore.publish = publish_after_the_loop_moved_on
train(cfg)
"""


def tensors_equal(a, b) -> bool:
    """Two loaded checkpoint objects hold the same tensors (exactly) in the same structure."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(tensors_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(tensors_equal(x, y) for x, y in zip(a, b))
    return True


@pytest.mark.slow
def test_background_save_under_zero2_writes_the_shards_a_synchronous_save_writes(tmp_path_factory, tiny_data):
    """ZeRO-2 on 2 processes with background writes: the DeepSpeed collective runs at the step, its files are
    written by the worker thread; the shards hold the synchronous run's tensors and the run trains alike."""
    sync = zero_pair(tmp_path_factory, tiny_data, 2)["a"]
    out, stderr = cached_run(tmp_path_factory, "zero2_background", tiny_data, [
        f"train.max_steps={STEPS}", f"checkpoint.every_steps={HALF}", "distributed.deepspeed_config=ds_configs/zero2.json",
        "checkpoint.background_save=true"], nproc=2)
    assert losses(out) == losses(sync)
    for step in (HALF, STEPS):
        ours, theirs = (run / "checkpoints" / step_dir_name(step) / "pytorch_model" for run in (out, sync))
        names = sorted(p.name for p in theirs.iterdir())
        assert sorted(p.name for p in ours.iterdir()) == names
        for name in names:
            assert tensors_equal(torch.load(ours / name, weights_only=False), torch.load(theirs / name, weights_only=False)), name
        read_checkpoint(out / "checkpoints" / step_dir_name(step))  # published with a complete manifest


@pytest.mark.slow
def test_kill_during_a_background_write_keeps_the_previous_checkpoint(tmp_path, tiny_data, plain):
    out = tmp_path / "run"
    every = 2
    settings = [f"train.max_steps={STEPS}", f"checkpoint.every_steps={every}", "checkpoint.background_save=true"]
    killed = run_script(["-c", KILL_DURING_BACKGROUND_WRITE, f"out_dir={out}", f"data.path={tiny_data}", *TINY_OVERRIDES,
                         *settings], check=False)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    root = out / "checkpoints"
    previous, unpublished = root / step_dir_name(every), root / f".tmp_{step_dir_name(2 * every)}"
    assert latest_name(root) == previous.name and find_resume_checkpoint("auto", root) == previous
    read_checkpoint(previous)  # complete
    assert (unpublished / "model.safetensors").is_file() and not (unpublished / STATE_FILE).exists()
    assert not (root / step_dir_name(2 * every)).exists()
    assert 2 * every + 1 in [step for step, _ in losses(out)]  # the loop trained on while the write was in flight

    resumed = run_train(out, tiny_data, settings)  # resume=auto
    assert f"Resumed from {previous}" in resumed.stderr
    assert [step for step, _ in losses(out)] == list(range(1, STEPS + 1))
    assert max_loss_diff([(s, l) for s, l in losses(out) if s > every], losses(plain)) <= LOSS_TOL
    assert latest_name(root) == step_dir_name(STEPS) and not list(root.glob(".tmp_*"))


@pytest.mark.parametrize("background", [False, True])
def test_sigterm_finishes_the_step_saves_and_exits_for_requeue(tmp_path, tiny_data, background):
    """With background writes too: the preemption's checkpoint is published before the exit."""
    out = tmp_path / "run"
    args = ["train.py", "recipes/tiny.yaml", f"out_dir={out}", f"data.path={tiny_data}", *TINY_OVERRIDES,
            "train.max_steps=400", "checkpoint.every_steps=0", "train.eval_every_steps=0",
            f"checkpoint.background_save={str(background).lower()}"]
    with open(tmp_path / "stderr.txt", "w") as err:
        proc = subprocess.Popen(launch_cmd(1) + args, cwd=ROOT, env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=err)
        deadline = time.monotonic() + 300
        while proc.poll() is None and time.monotonic() < deadline:
            if any(step >= 2 for step in logged_steps_while_running(out)):
                break
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        returncode = proc.wait(timeout=300)
    stderr = (tmp_path / "stderr.txt").read_text()
    assert returncode == EXIT_PREEMPTED, stderr[-3000:]
    step = losses(out)[-1][0]
    assert 2 <= step < 400
    root = out / "checkpoints"
    assert latest_name(root) == step_dir_name(step) and read_checkpoint(root / step_dir_name(step))["state"]["step"] == step
    assert json.loads((out / PREEMPTED_MARKER).read_text())["step"] == step
    assert "Stopped by SIGTERM" in stderr
    assert find_resume_checkpoint("auto", root) == root / step_dir_name(step)  # what the requeued job resumes from


# ---------------------------------------------------------------------------------------------- bad input


@pytest.fixture
def damaged(tmp_path, plain) -> Path:
    """A writable copy of the plain run's last checkpoint."""
    copy = tmp_path / step_dir_name(STEPS)
    shutil.copytree(plain / "checkpoints" / step_dir_name(STEPS), copy)
    return copy


def test_truncated_shard_is_refused(damaged):
    shard = damaged / "model.safetensors"
    os.truncate(shard, shard.stat().st_size // 2)
    with pytest.raises(UserError, match=r"is damaged: model\.safetensors holds \d+ bytes instead of \d+ \(truncated"):
        read_checkpoint(damaged)


def test_missing_shard_is_refused(damaged):
    (damaged / "optimizer.bin").unlink()
    with pytest.raises(UserError, match=r"is damaged: optimizer\.bin is missing"):
        read_checkpoint(damaged)


def test_checkpoint_without_training_state_is_refused(damaged):
    (damaged / STATE_FILE).unlink()
    with pytest.raises(UserError, match="has no train_state.json: it is not a complete checkpoint"):
        read_checkpoint(damaged)


def test_resume_that_changes_the_model_or_data_shape_stops(tmp_path, tiny_data, plain):
    source = plain / "checkpoints" / step_dir_name(STEPS)
    before = tree_digest(source)
    proc = run_train(tmp_path / "run", tiny_data, [f"checkpoint.resume={source}", f"train.max_steps={STEPS + 2}",
                                                   "model.hidden_size=32", "data.seq_len=16"], check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "Cannot resume from" in proc.stderr
    assert "model.hidden_size: 64 -> 32" in proc.stderr and "data.seq_len: 32 -> 16" in proc.stderr
    assert tree_digest(source) == before


# ---------------------------------------------------------------------------------------------- 2 processes, DeepSpeed


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_zero_resume_is_exact_and_leaves_its_source_untouched(tmp_path_factory, tiny_data, stage):
    runs = zero_pair(tmp_path_factory, tiny_data, stage)
    resumed = losses(runs["b"])
    assert [step for step, _ in resumed] == list(range(HALF + 1, STEPS + 1))
    diff = max_loss_diff(resumed, losses(runs["a"]))
    print(f"ZeRO-{stage}, 2 processes: max |loss difference| after resume = {diff:.3g}")
    assert diff <= LOSS_TOL
    assert tree_digest(runs["source"]) == runs["source_digest"]
    for run in (runs["a"], runs["b"]):  # the per-layer gradient norms, read before the engine steps, add up
        assert_layer_norms_add_up(run)
    saved = read_checkpoint(runs["a"] / "checkpoints" / step_dir_name(STEPS))
    assert saved["topology"] == {"world_size": 2, "deepspeed": True, "zero_stage": stage, "offload_optimizer": False,
                                 "offload_param": False, "sequence_parallel_size": 1,
                                 "tensor_parallel_size": 1, "expert_parallel_size": 1}
    assert sorted(p.name for p in (runs["a"] / "checkpoints" / step_dir_name(STEPS) / "rng").iterdir()) == [
        "rank_00000.safetensors", "rank_00001.safetensors"]
    if stage == 3:  # a harmless change (another DeepSpeed JSON of the same stage) is allowed and listed
        assert "Resuming with changed settings (allowed)" in runs["b_stderr"]
        assert "distributed.deepspeed_config:" in runs["b_stderr"]


def test_a_finished_run_run_again_has_nothing_to_do_and_writes_nothing(tmp_path, plain, caplog):
    from lmrecipe.config import load_config
    from lmrecipe.train.trainer import train

    out = tmp_path / "run"
    shutil.copytree(plain, out)  # the shared run stays untouched whatever happens here
    before = {p: (p.stat().st_mtime_ns, p.stat().st_size) for p in [out, *out.rglob("*")]}
    digest = tree_digest(out)
    cfg = load_config(str(out / "config.yaml"), [f"out_dir={out}"])  # the run's own command, in this process
    with caplog.at_level(logging.INFO, logger="lmrecipe.train.trainer"):
        state = train(cfg)
    assert state.step == STEPS
    assert f"nothing to do: {out} already finished at step {STEPS} (train.max_steps={STEPS})" in caplog.text
    assert "schedule.decay=constant optim.lr=" in caplog.text and "checkpoint.branch_from=" in caplog.text
    assert {p: (p.stat().st_mtime_ns, p.stat().st_size) for p in [out, *out.rglob("*")]} == before
    assert tree_digest(out) == digest
