"""slurm/ on a real two-node SLURM cluster (tests/slurm_cluster.py): train.sbatch on 2 nodes x 1 CPU process
to completion; a stop during start-up that is not lost, then a SIGUSR1 preemption -> checkpoint -> requeue ->
exact resume; a frozen rank -> the hang watchdog's exit 3 -> the step run again in the same allocation -> exact
resume; compare_zero.sbatch (which is also the test of tools/compare_zero.py's comparison). One cluster and
one uninterrupted reference run serve every test. The reference run first prepares its data with prepare.sbatch, a
3-task array job writing a shard set, and trains on that set; the other runs read the one-folder preparation of the
same corpus, so their equal losses show that a shard set trains exactly like the folder."""

import csv
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import ROOT, TINY_OVERRIDES, rank_pid, subprocess_env

from lmrecipe.observe.goodput import read_sessions, summarize
from lmrecipe.train.callbacks.preemption import process_alive

MAX_STEPS = 300  # about 10 s of training: long enough to preempt in the middle
OVERRIDES = [*TINY_OVERRIDES, f"train.max_steps={MAX_STEPS}", "checkpoint.every_steps=0"]
JOB_TIMEOUT_S = 600
pytestmark = pytest.mark.slow  # every test here runs SLURM jobs of two processes


def job_env(cluster, **extra) -> dict:
    """What a user's shell passes to sbatch (SLURM exports it to the job): the project's Python, this cluster."""
    env = {**subprocess_env(), "SLURM_CONF": cluster.env["SLURM_CONF"], "PYTHON": sys.executable}
    env.pop("LMRECIPE_PROCS_PER_NODE", None)
    return {**env, **extra}


def submit(cluster, script: str, args: list[str], output: Path, sbatch_args=(), **env) -> tuple[subprocess.Popen, str]:
    """`sbatch --wait` in the background from the repository root; returns the process and the job id."""
    cmd = ["sbatch", "--wait", "--parsable", f"--output={output}", *sbatch_args, script, *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=job_env(cluster, **env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    job_id = proc.stdout.readline().strip().split(";")[0]
    assert job_id.isdigit(), f"sbatch printed {job_id!r}: {proc.stderr.read() if proc.poll() is not None else ''}"
    return proc, job_id


def finish(cluster, proc: subprocess.Popen, output: Path) -> str:
    try:
        _, err = proc.communicate(timeout=JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"job still running after {JOB_TIMEOUT_S} s\n{output.read_text()[-6000:]}\n{cluster.logs()}")
    log = output.read_text(errors="replace") if output.exists() else ""
    assert proc.returncode == 0, f"sbatch exited {proc.returncode}: {err}\n{log[-6000:]}\n{cluster.logs()}"
    return log


def train_args(out_dir: Path, data: Path) -> list[str]:
    return ["recipes/tiny.yaml", f"out_dir={out_dir}", f"data.path={data}", *OVERRIDES]


def losses(out_dir: Path) -> dict[int, float]:
    """Loss per step; after a resume the file also holds the rows of the abandoned continuation: keep the last."""
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def wait_for(condition, what: str, timeout_s: float = 300, proc: subprocess.Popen | None = None, output: Path | None = None):
    deadline = time.monotonic() + timeout_s
    while not condition():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the job ended before {what}\n{output.read_text()[-6000:] if output else ''}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout_s:.0f} s\n{output.read_text()[-6000:] if output else ''}")
        time.sleep(0.1)


PREPARE_TASKS = 3


@pytest.fixture(scope="module")
def reference_run(slurm_cluster, tiny_data, corpus_dir, tmp_path_factory):
    """tiny_data's corpus prepared by `sbatch --array=0-2 slurm/prepare.sbatch` (with tiny_data's tokenizer), then an
    uninterrupted `sbatch -N2 slurm/train.sbatch` run on that shard set: its log, out_dir, the set and the array's
    logs."""
    tmp = tmp_path_factory.mktemp("slurm_reference")
    shard_set = tmp / "shards"
    args = ["--input", str(corpus_dir), "--tokenizer", str(tiny_data), "--val-fraction", "0.1", "--output", str(shard_set)]
    proc, _ = submit(slurm_cluster, "slurm/prepare.sbatch", args, tmp / "prepare-%a.out", [f"--array=0-{PREPARE_TASKS - 1}"])
    finish(slurm_cluster, proc, tmp / "prepare-0.out")
    prepare_logs = [(tmp / f"prepare-{i}.out").read_text() for i in range(PREPARE_TASKS)]
    out_dir, output = tmp / "run", tmp / "slurm.out"
    proc, _ = submit(slurm_cluster, "slurm/train.sbatch", train_args(out_dir, shard_set), output, ["-N2"])
    return finish(slurm_cluster, proc, output), out_dir, shard_set, prepare_logs


def test_prepare_array_job_writes_a_shard_set_that_train_sbatch_trains_on(reference_run, tiny_data):
    _, out_dir, shard_set, prepare_logs = reference_run
    for task, log in enumerate(prepare_logs):
        assert f"task {task} on " in log and f"shard {task} of {PREPARE_TASKS}" in log, log[-3000:]
    assert any(f"wrote {shard_set / 'meta.json'}: {PREPARE_TASKS} shards" in log for log in prepare_logs)
    meta = json.loads((shard_set / "meta.json").read_text())
    assert [e["path"] for e in meta["shards"]] == [f"shard-{i:05d}-of-{PREPARE_TASKS:05d}" for i in range(PREPARE_TASKS)]
    tokens = b"".join((shard_set / e["path"] / "train.bin").read_bytes() for e in meta["shards"])
    assert tokens == (tiny_data / "train.bin").read_bytes()
    assert json.loads((out_dir / "run_meta.json").read_text())["config"]["data"]["path"] == str(shard_set)


def test_train_sbatch_on_two_cpu_nodes(reference_run):
    log, out_dir = reference_run[:2]
    # One launcher per node, one process each (no GPUs), rendezvous at n1's NodeAddr rather than its name.
    for node in (0, 1):
        assert re.search(rf"\[launch\] node {node} of 2 on .*: 1 processes per node x 1 threads, 2 processes in all, "
                         r"rendezvous 127\.0\.0\.1:\d+", log), log[-4000:]
    assert "[sbatch] finished with exit code 0" in log and "requeue" not in log
    assert json.loads((out_dir / "run_meta.json").read_text())["world_size"] == 2
    assert sorted(losses(out_dir)) == list(range(1, MAX_STEPS + 1))
    assert (out_dir / "checkpoints" / "latest").read_text().strip() == f"step_{MAX_STEPS:08d}"


def test_stops_during_start_up_and_mid_training_requeue_and_resume_exactly(slurm_cluster, tiny_data, tmp_path,
                                                                          reference_run):
    """`scancel --signal=USR1 --batch` twice: while the launchers start (no training process can take it yet),
    then mid-training. Each ends in a requeue; the second saves a checkpoint that the third run resumes from,
    and the losses equal the uninterrupted run's."""
    out_dir, output = tmp_path / "run", tmp_path / "slurm.out"
    metrics = out_dir / "metrics.jsonl"
    proc, job_id = submit(slurm_cluster, "slurm/train.sbatch", train_args(out_dir, tiny_data), output, ["-N2"])

    def launches() -> int:  # launch.sh starts, one per node and run ("[launch] node 0 of 2 on ...")
        return len(re.findall(r"\[launch\] node \d+ of \d+", output.read_text())) if output.exists() else 0

    def rows() -> int:
        return len(metrics.read_text().splitlines()) if metrics.exists() else 0


    wait_for(lambda: launches() == 2, "launcher start", proc=proc, output=output)
    assert rows() == 0  # training has not started
    slurm_cluster.run(["scancel", "--signal=USR1", "--batch", job_id])
    wait_for(lambda: f"job {job_id} (restart 1)" in output.read_text() and launches() == 4, "restart", proc=proc,
             output=output)
    rows_before = rows()  # a step may have been trained when the first stop reached the workers
    wait_for(lambda: rows() > rows_before, "training step after the restart", proc=proc, output=output)
    slurm_cluster.run(["scancel", "--signal=USR1", "--batch", job_id])
    log = finish(slurm_cluster, proc, output)

    assert log.count(f"requeueing job {job_id}") == 2 and f"job {job_id} (restart 2)" in log, log[-6000:]
    stopped = re.findall(r"Stopped by SIGUSR1 after step (\d+); checkpoint saved", log)
    assert stopped, log[-6000:]
    stopped_at = int(stopped[-1])
    assert 1 <= stopped_at < MAX_STEPS
    assert f"Resumed from {out_dir / 'checkpoints' / f'step_{stopped_at:08d}'} at step {stopped_at}" in log
    assert [c["JobState"] for c in slurm_cluster.completions() if c.get("JobId") == job_id][-1] == "COMPLETED"

    expected, got = losses(reference_run[1]), losses(out_dir)
    assert sorted(got) == list(range(1, MAX_STEPS + 1))
    assert got == pytest.approx(expected, abs=1e-5)


HANG_BUDGETS = ["distributed.timeout_s=120", "distributed.hang_step_floor_s=4", "distributed.hang_first_step_s=60",
                "distributed.hang_checkpoint_s=60", "distributed.hang_eval_s=60"]


def test_a_hang_runs_the_step_again_in_the_allocation_and_resumes_exactly(slurm_cluster, tiny_data, tmp_path,
                                                                         reference_run):
    """Rank 1 (node n2) frozen with SIGSTOP mid-training: the watchdog ends the step (exit 3), train.sbatch runs it
    again in the same allocation (no requeue), the run resumes from its newest checkpoint, its losses equal the
    uninterrupted run's, and run_meta.json, the report and goodput.json record the restart."""
    out_dir, output = tmp_path / "run", tmp_path / "slurm.out"
    metrics = out_dir / "metrics.jsonl"
    args = [*train_args(out_dir, tiny_data), "checkpoint.every_steps=20", *HANG_BUDGETS]
    proc, job_id = submit(slurm_cluster, "slurm/train.sbatch", args, output, ["-N2"])
    frozen = None
    try:
        wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) > 30, "training steps", proc=proc,
                 output=output)
        frozen = rank_pid(out_dir, 1)
        os.kill(frozen, signal.SIGSTOP)
        log = finish(slurm_cluster, proc, output)
    finally:
        if frozen is not None and process_alive(frozen):
            os.kill(frozen, signal.SIGKILL)
    assert "[sbatch] the training step ended after a hang" in log and "requeueing" not in log, log[-6000:]
    assert "[sbatch] finished with exit code 0" in log
    launches = json.loads((out_dir / "run_meta.json").read_text())["launches"]
    assert len(launches) == 2 and launches[1]["resumed_from"], launches
    assert {k: launches[1]["launcher_env"].get(k) for k in ("LMRECIPE_JOB_RESTART", "LMRECIPE_JOB_RESTART_REASON",
                                                            "SLURM_JOB_ID")} == {
        "LMRECIPE_JOB_RESTART": "1", "LMRECIPE_JOB_RESTART_REASON": "a hang", "SLURM_JOB_ID": job_id}
    assert "run again in the same job after a hang (restart 1)" in (out_dir / "report.md").read_text()
    account = summarize(read_sessions(out_dir))
    assert account["sessions"] == 2 and account["restart_s"] > 0
    expected, got = losses(reference_run[1]), losses(out_dir)
    assert sorted(got) == list(range(1, MAX_STEPS + 1))
    assert got == pytest.approx(expected, abs=1e-5)


def test_requeue_on_fewer_nodes_resumes_zero2_on_the_new_process_count(slurm_cluster, tiny_data, tmp_path,
                                                                      reference_run):
    """A ZeRO-2 job on 2 nodes loses node n2 (drained) and is stopped; its requeued run, given one node, resumes
    the 2-process ZeRO shards on 1 process and finishes the run."""
    out_dir, output = tmp_path / "run", tmp_path / "slurm.out"
    metrics = out_dir / "metrics.jsonl"
    args = [*train_args(out_dir, tiny_data), "distributed.deepspeed_config=ds_configs/zero2.json"]
    proc, job_id = submit(slurm_cluster, "slurm/train.sbatch", args, output, ["-N2"])
    try:
        wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) > 1, "training steps", proc=proc,
                 output=output)
        slurm_cluster.run(["scontrol", "update", "nodename=n2", "state=drain", "reason=lmrecipe-test"])
        slurm_cluster.run(["scancel", "--signal=USR1", "--batch", job_id])
        # Requeued, the job waits for 2 nodes (1 task each) that no longer exist: give it the one that is left. slurmctld may
        # apply the request only once the requeue has settled, so it is repeated until the job runs again.
        def restarted_on_one_node() -> bool:
            if f"job {job_id} (restart 1)" in output.read_text():
                return True
            if slurm_cluster.job_state(job_id) == "PENDING":
                slurm_cluster.run(["scontrol", "update", f"jobid={job_id}", "NumNodes=1", "NumTasks=1"], check=False)
                time.sleep(1)
            return False

        wait_for(restarted_on_one_node, "restart on one node", proc=proc, output=output)
        log = finish(slurm_cluster, proc, output)
    finally:
        slurm_cluster.run(["scontrol", "update", "nodename=n2", "state=resume"], check=False)
    assert re.search(r"\[launch\] node 0 of 2 on .*2 processes in all", log), log[-4000:]
    assert re.search(r"\[launch\] node 0 of 1 on .*1 processes in all", log), log[-4000:]
    stopped_at = int(re.findall(r"Stopped by SIGUSR1 after step (\d+); checkpoint saved", log)[-1])
    assert f"at step {stopped_at} (" in log and "on a new layout: processes 2 -> 1." in log, log[-6000:]
    expected, got = losses(reference_run[1]), losses(out_dir)
    assert sorted(got) == list(range(1, MAX_STEPS + 1))
    worst = max(abs(got[step] - expected[step]) for step in got)
    print(f"ZeRO-2, 2 nodes -> 1 node after step {stopped_at}: max |loss difference| vs the 2-node run without "
          f"DeepSpeed = {worst:.3g}")
    assert worst <= 1e-4  # ZeRO-2 and plain DDP sum gradients in different orders: a few 1e-6 per step


def test_compare_zero_sbatch(slurm_cluster, tiny_data, tmp_path):
    """slurm/compare_zero.sbatch runs tools/compare_zero.py: 2 processes, 3 steps, no DeepSpeed against ZeRO-3."""
    out, output = tmp_path / "compare", tmp_path / "slurm.out"
    configs = ["none", "zero3"]
    args = ["recipes/tiny.yaml", f"data.path={tiny_data}", *TINY_OVERRIDES, "--configs", ",".join(configs), "--steps",
            "3", "--out", str(out)]
    proc, _ = submit(slurm_cluster, "slurm/compare_zero.sbatch", args, output, LMRECIPE_PROCS_PER_NODE="2")
    log = finish(slurm_cluster, proc, output)
    assert "training 3 steps on 2 processes" in log  # LMRECIPE_PROCS_PER_NODE, passed on as --nproc
    assert "[2/2] zero3: done" in log  # progress is printed per config

    rows = {r["config"]: r for r in csv.DictReader((out / "results.csv").open())}
    assert list(rows) == configs, log[-4000:]
    for name, row in rows.items():
        assert row["status"] == "ok", row
        assert float(row["tokens_per_sec"]) > 0
        assert abs(float(row["final_loss"]) - float(rows["none"]["final_loss"])) < 1e-4
        # fp32 on a CPU: every stage computes the same losses up to reduction order.
        assert float(row["max_loss_diff_vs_none"]) < 1e-4, name
        # Model-state bytes measured from the tensors agree with lmrecipe.planning.memory's estimate.
        assert float(row["measured_over_estimated"]) == pytest.approx(1.0, abs=0.10), row
        assert float(row["memory_per_rank_gb"]) == pytest.approx(float(row["model_states_measured_mb"]) / 1e3)
    assert float(rows["zero3"]["model_states_measured_mb"]) < float(rows["none"]["model_states_measured_mb"])

    table = (out / "results.md").read_text()
    for name in configs:
        assert f"| {name} |" in table
    png = (out / "memory_throughput.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
