"""The hang watchdog under a real 2-process launch: a rank frozen with SIGSTOP is named in hang.md and the run ends
within its budget + 60 s (exit 3 in ``$LMRECIPE_EXIT_FILE``); a checkpoint and an evaluation slower than the step's
budget but within their own do not trip it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers import ROOT, TINY_OVERRIDES, launch_cmd, rank_pid, run_script, subprocess_env

from lmrecipe.observe.metrics_log import read_metrics

BUDGETS = ["distributed.timeout_s=120", "distributed.hang_step_floor_s=4", "distributed.hang_first_step_s=60",
           "distributed.hang_checkpoint_s=60", "distributed.hang_eval_s=60"]


def _steps(out: Path) -> int:
    try:
        return max((r["step"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r), default=0)
    except (OSError, ValueError):
        return 0


@pytest.mark.slow
def test_a_frozen_rank_is_named_and_the_run_ends_within_its_budget(tmp_path, tiny_data):
    out, exit_file = tmp_path / "run", tmp_path / "exit.json"
    args = ["train.py", "recipes/tiny.yaml", f"out_dir={out}", f"data.path={tiny_data}", *TINY_OVERRIDES, *BUDGETS,
            "train.max_steps=100000", "checkpoint.every_steps=0", "train.eval_every_steps=0"]
    env = {**subprocess_env(), "LMRECIPE_EXIT_FILE": str(exit_file), "TORCH_FR_BUFFER_SIZE": "2000"}
    launcher = subprocess.Popen(launch_cmd(2) + args, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.time() + 180
        while time.time() < deadline and _steps(out) < 6 and launcher.poll() is None:
            time.sleep(0.2)
        rank1 = rank_pid(out, 1)
        os.kill(rank1, signal.SIGSTOP)
        frozen_at = time.monotonic()
        _, stderr = launcher.communicate(timeout=4 + 60 + 30)
        ended_s = time.monotonic() - frozen_at
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    assert launcher.returncode != 0 and ended_s < 4 + 60, stderr[-4000:]
    report = (out / "hang.md").read_text()
    assert f"**Stuck: rank 1 (pid {rank1} on " in report and "frozen" in report, report
    assert "- Waiting: rank 0 (pid " in report
    assert "in _run" in (out / "hang_stacks_rank0.txt").read_text()  # the watchdog's own thread, among all
    assert json.loads((out / "hang_flight_rank0.json").read_text())["entries"]  # gloo's collectives recorded
    assert json.loads(exit_file.read_text())["exit_code"] == 3
    assert "Training stopped by the hang watchdog: rank 1" in stderr
    assert not Path(f"/proc/{rank1}").exists() or "Z" in Path(f"/proc/{rank1}/stat").read_text().split(")")[-1][:3]
    print(f"frozen -> launcher exit: {ended_s:.1f} s")


SLOW_RANK0 = """import os, runpy, sys, time
sys.path.insert(0, {root!r})
from lmrecipe.checkpoint.saving import Saver
from lmrecipe.train.validation import Validation

def slowed(method):
    def slow(*args, **kwargs):
        if os.environ.get("RANK") == "0":
            time.sleep({sleep_s})
        return method(*args, **kwargs)
    return slow

Saver._write_small_files = slowed(Saver._write_small_files)
Validation.losses = slowed(Validation.losses)
sys.argv = ["train.py", *sys.argv[1:]]
runpy.run_path("train.py", run_name="__main__")
"""


@pytest.mark.slow
def test_a_slow_checkpoint_and_evaluation_within_their_budgets_do_not_trip(tmp_path, tiny_data):
    """Rank 0 takes 6 s over a checkpoint and over an evaluation (rank 1 waits for it), against a step budget of 3 s."""
    driver = tmp_path / "slow_rank0.py"
    driver.write_text(SLOW_RANK0.format(root=str(ROOT), sleep_s=6))
    out = tmp_path / "run"
    proc = run_script([str(driver), "recipes/tiny.yaml", f"out_dir={out}", f"data.path={tiny_data}", *TINY_OVERRIDES,
                       *BUDGETS, "distributed.hang_step_s=3", "distributed.hang_checkpoint_s=20",
                       "distributed.hang_eval_s=20", "train.max_steps=3", "checkpoint.every_steps=3",
                       "train.eval_every_steps=3"], nproc=2, timeout=300)
    assert proc.returncode == 0 and not (out / "hang.md").exists()
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl") if "val_loss" in r] == [3]
    assert (out / "checkpoints" / "latest").is_file()


STUCK_RANK1 = """import os, runpy, sys, time
sys.path.insert(0, {root!r})
import torch.distributed as dist
from lmrecipe.checkpoint.saving import Saver
from lmrecipe.data.batches import Prefetcher

RANK, CASE = os.environ.get("RANK"), {case!r}
write, get, groups = Saver._write_small_files, Prefetcher.get, []

def write_stuck(self, *args, **kwargs):
    if CASE == "checkpoint" and RANK == "1":
        time.sleep(10**6)  # a dead filesystem: the write never returns
    return write(self, *args, **kwargs)

def get_stuck(self, step):
    if CASE == "subgroup":
        if not groups:
            groups.append(dist.new_group([0, 1]))  # every rank makes it (its first step); only rank 1 uses it
        if RANK == "1" and step == 4:
            dist.barrier(group=groups[0])  # a collective its peer never calls
    return get(self, step)

Saver._write_small_files, Prefetcher.get = write_stuck, get_stuck
sys.argv = ["train.py", *sys.argv[1:]]
runpy.run_path("train.py", run_name="__main__")
"""


@pytest.mark.slow
@pytest.mark.parametrize("case, phase", [("checkpoint", "checkpoint"), ("subgroup", "forward/backward")])
def test_a_live_rank_stuck_in_a_write_or_a_collective_is_named(tmp_path, tiny_data, case, phase):
    """Rank 1 stays alive but never returns: from a checkpoint write, or from a barrier on a group rank 0 never
    calls. Its own watcher (or rank 0's) names it in hang.md with its stacks, and the run ends within the budget
    + 60 s with exit 3."""
    driver = tmp_path / "stuck_rank1.py"
    driver.write_text(STUCK_RANK1.format(root=str(ROOT), case=case))
    out, exit_file = tmp_path / "run", tmp_path / "exit.json"
    budget_s = 6
    start = time.monotonic()
    proc = run_script([str(driver), "recipes/tiny.yaml", f"out_dir={out}", f"data.path={tiny_data}", *TINY_OVERRIDES,
                       *BUDGETS, "distributed.hang_step_s=4", f"distributed.hang_checkpoint_s={budget_s}",
                       "train.max_steps=100000", "checkpoint.every_steps=3", "train.eval_every_steps=0"],
                      nproc=2, timeout=300, check=False, env_extra={"LMRECIPE_EXIT_FILE": str(exit_file),
                                                                    "TORCH_FR_BUFFER_SIZE": "2000"})
    ended_s = time.monotonic() - start
    report = (out / "hang.md").read_text()
    assert proc.returncode != 0 and json.loads(exit_file.read_text())["exit_code"] == 3, proc.stderr[-3000:]
    assert "**Stuck: rank 1 (pid " in report and f", {phase}, for " in report.split("- Waiting")[0], report
    stacks = (out / "hang_stacks_rank1.txt").read_text()  # a live stuck rank dumps its own stacks
    assert ("write_stuck" if case == "checkpoint" else "get_stuck") in stacks
    steps = _steps(out)
    assert ended_s < 120 + budget_s + 60 and steps <= 6, (ended_s, steps)
    stuck_s = float(report.split(f", {phase}, for ")[1].split(" s")[0])
    print(f"{case}: stuck {stuck_s:.0f} s at the verdict (budget {budget_s if case == 'checkpoint' else 4} s); "
          f"launch to exit {ended_s:.1f} s")
