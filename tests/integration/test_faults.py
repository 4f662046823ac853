"""Faults a real run meets: a second run on the same out_dir, an abandoned continuation, a dead launcher, a full
disk, a bad input under a launcher. Each ends with a clear message or a clean stop, and loses nothing."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from helpers import ROOT, TINY_OVERRIDES, launch_cmd, run_train, subprocess_env

from lmrecipe.checkpoint.storage import LATEST, PREEMPTED_MARKER, step_dir_name
from lmrecipe.observe.metrics_log import read_metrics
from lmrecipe.train.lock import LOCK_FILE


def train_steps(out: Path) -> list[int]:
    return [r["step"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r]


def test_a_live_run_keeps_its_out_dir(tmp_path, tiny_data):
    out = tmp_path / "run"
    out.mkdir()
    holder = {"host": socket.gethostname(), "pid": os.getpid(), "started": "earlier", "slurm_job_id": None}
    (out / LOCK_FILE).write_text(json.dumps(holder))  # this test's own process: alive
    proc = run_train(out, tiny_data, ["train.max_steps=2"], check=False)
    assert proc.returncode == 2
    assert f"in use by another training run (pid {os.getpid()}" in proc.stderr and "Traceback" not in proc.stderr
    assert not (out / "checkpoints").exists() and not (out / "metrics.jsonl").exists()
    assert json.loads((out / LOCK_FILE).read_text()) == holder  # the holder's lock is left alone


def test_a_dead_runs_lock_is_taken_over_and_released(tmp_path, tiny_data):
    out = tmp_path / "run"
    out.mkdir()
    dead = subprocess.Popen(["true"])
    dead.wait()
    (out / LOCK_FILE).write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid, "started": "earlier"}))
    proc = run_train(out, tiny_data, ["train.max_steps=2"])
    assert f"process {dead.pid} on this host no longer exists" in proc.stderr
    assert train_steps(out) == [1, 2]
    assert not (out / LOCK_FILE).exists()  # released at the end


def test_resume_drops_the_abandoned_continuations_rows(tmp_path, tiny_data):
    out = tmp_path / "run"
    run_train(out, tiny_data, ["train.max_steps=4", "checkpoint.every_steps=2", "train.eval_every_steps=2"])
    first = read_metrics(out / "metrics.jsonl")
    run_train(out, tiny_data, ["train.max_steps=4", "checkpoint.every_steps=2", "train.eval_every_steps=2",
                               f"checkpoint.resume={out / 'checkpoints' / step_dir_name(2)}"])
    rows = read_metrics(out / "metrics.jsonl")
    assert train_steps(out) == [1, 2, 3, 4]  # once each, not 1 2 3 4 3 4
    assert [r["step"] for r in rows if "val_loss" in r] == [2, 4]
    assert rows[:3] == [r for r in first if r["step"] <= 2]  # the kept history is untouched


@pytest.mark.slow
def test_batch_error_is_printed_once_under_a_launcher(tmp_path, tiny_data):
    proc = run_train(tmp_path / "run", tiny_data, ["train.global_batch_size=12", "train.micro_batch_size=4"],
                     nproc=2, check=False)
    assert proc.returncode != 0
    assert proc.stderr.count("error: train.global_batch_size=12 is not a multiple") == 1, proc.stderr[-3000:]


@pytest.mark.slow
def test_ranks_of_a_dead_launcher_stop_with_a_checkpoint(tmp_path, tiny_data):
    """SIGUSR1 kills a bare `accelerate launch` at once; its orphaned ranks notice, save and stop."""
    out = tmp_path / "run"
    args = ["train.py", "recipes/tiny.yaml", f"out_dir={out}", f"data.path={tiny_data}", *TINY_OVERRIDES,
            "train.max_steps=100000", "checkpoint.every_steps=0", "train.eval_every_steps=0"]
    launcher = subprocess.Popen(launch_cmd(2) + args, cwd=ROOT, env=subprocess_env(), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.time() + 300
        while time.time() < deadline and len(train_steps(out)) < 3:
            time.sleep(0.5)
        assert len(train_steps(out)) >= 3, "training did not start"
        launcher.send_signal(signal.SIGUSR1)
        assert launcher.wait(timeout=30) != 0  # the launcher itself dies at once
        while time.time() < deadline and not (out / PREEMPTED_MARKER).is_file():
            time.sleep(0.5)
        marker = json.loads((out / PREEMPTED_MARKER).read_text())
        saved = out / "checkpoints" / (out / "checkpoints" / LATEST).read_text().strip()
        assert str(saved) == marker["checkpoint"] and (saved / "train_state.json").is_file()
        while time.time() < deadline and _ranks_alive(out):
            time.sleep(0.5)
        assert not _ranks_alive(out), "orphaned ranks kept running"
    finally:
        if _ranks_alive(out):
            os.killpg(launcher.pid, signal.SIGKILL)


def _ranks_alive(out: Path) -> bool:
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and f"out_dir={out}".encode() in (proc / "cmdline").read_bytes():
                return True
        except OSError:
            continue
    return False


@pytest.fixture
def small_disk(tmp_path):
    """A real 4 MB filesystem (tmpfs), so a checkpoint meets a full disk (needs root)."""
    mount = tmp_path / "small"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)]).returncode:
        pytest.skip("mounting a small tmpfs needs root")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_full_disk_during_a_checkpoint_is_a_clear_error(small_disk, tiny_data):
    out = small_disk / "run"
    proc = run_train(out, tiny_data, ["train.max_steps=40", "checkpoint.every_steps=2", "checkpoint.keep_last=10",
                                      "train.eval_every_steps=0"], check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "No space left on the device while writing checkpoint" in proc.stderr and "Traceback" not in proc.stderr
    root = out / "checkpoints"
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp_")]  # the partial folder is gone
    latest = root / (root / LATEST).read_text().strip()
    assert f"previous checkpoint {latest} is intact" in proc.stderr
    assert json.loads((latest / "train_state.json").read_text())["state"]["step"] >= 2
    assert not (out / LOCK_FILE).exists()
