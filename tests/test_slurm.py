"""slurm/: shellcheck, the launch command built from SLURM's environment, requeue on preemption, and a
two-node run simulated on this machine (two launchers, one process per "node", rendezvous on 127.0.0.1)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, TINY_OVERRIDES, free_port, run_train, subprocess_env

SCRIPTS = sorted((ROOT / "slurm").glob("*.sh")) + sorted((ROOT / "slurm").glob("*.sbatch"))


def fake_commands(bin_dir: Path, **scripts: str) -> dict:
    """Put executable stand-ins (srun, scontrol, ...) first on PATH; returns the environment to use."""
    bin_dir.mkdir(exist_ok=True)
    for name, body in scripts.items():
        path = bin_dir / name
        path.write_text("#!/usr/bin/env bash\n" + body + "\n")
        path.chmod(0o755)
    env = subprocess_env()
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    env["PYTHON"] = sys.executable
    return env


def test_shell_scripts_pass_shellcheck():
    shellcheck = Path(sys.executable).with_name("shellcheck")
    assert {p.name for p in SCRIPTS} >= {"launch.sh", "train.sbatch", "compare_zero.sbatch"}
    proc = subprocess.run([str(shellcheck), "--shell=bash", *map(str, SCRIPTS)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def dry_run(tmp_path, overrides, **env_vars) -> subprocess.CompletedProcess:
    env = fake_commands(tmp_path / "bin", scontrol='[[ "$1 $2" == "show hostnames" ]] && printf "gpu-a\\ngpu-b\\ngpu-c\\ngpu-d\\n"')
    env.update(LAUNCH_DRY_RUN="1", **env_vars)
    return subprocess.run(["bash", "slurm/launch.sh", "recipes/tiny.yaml", *overrides], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)


def test_launch_command_from_slurm_environment(tmp_path):
    proc = dry_run(tmp_path, ["distributed.deepspeed_config=ds_configs/zero2.json", "optim.lr=1e-3"],
                   SLURM_JOB_NODELIST="gpu-[a-d]", SLURM_NNODES="4", SLURM_NODEID="2", SLURM_GPUS_ON_NODE="8",
                   SLURM_JOB_ID="123456")
    assert proc.returncode == 0, proc.stderr
    cmd = proc.stdout.split()
    flags = dict(zip(cmd, cmd[1:]))
    assert flags["--num_machines"] == "4" and flags["--machine_rank"] == "2"
    assert flags["--main_process_ip"] == "gpu-a"  # first host of the expanded node list
    assert flags["--main_process_port"] == str(20000 + 123456 % 20000)
    assert flags["--num_processes"] == "32"  # 4 nodes x 8 GPUs
    assert flags["--deepspeed_multinode_launcher"] == "standard" and "--use_deepspeed" in cmd
    # The recipe and overrides pass through untouched, after the training script.
    assert cmd[cmd.index(str(ROOT / "train.py")) + 1:] == [
        "recipes/tiny.yaml", "distributed.deepspeed_config=ds_configs/zero2.json", "optim.lr=1e-3"]


def test_launch_without_deepspeed_uses_multi_gpu(tmp_path):
    proc = dry_run(tmp_path, [], MASTER_ADDR="10.0.0.7", MASTER_PORT="29999", SLURM_NNODES="2", SLURM_NODEID="0",
                   GPUS_PER_NODE="4")
    assert proc.returncode == 0, proc.stderr
    cmd = proc.stdout.split()
    assert "--multi_gpu" in cmd and "--use_deepspeed" not in cmd
    assert "10.0.0.7" in cmd and "29999" in cmd and cmd[cmd.index("--num_processes") + 1] == "8"


def test_launch_rejects_a_bad_recipe_before_launching(tmp_path):
    proc = dry_run(tmp_path, ["optim.lr_typo=1"], MASTER_ADDR="127.0.0.1")
    assert proc.returncode == 2
    assert "Unknown config key optim.lr_typo" in proc.stderr and "Traceback" not in proc.stderr
    assert "accelerate" not in proc.stdout


# A stand-in srun: records its arguments, then exits with FAKE_SRUN_EXIT, or waits for SIGUSR1 and exits 124
# the way the training step does after saving a checkpoint.
FAKE_SRUN = """
echo "$@" > "$FAKE_LOG/srun_args"
if [[ -n "${FAKE_SRUN_EXIT:-}" ]]; then exit "$FAKE_SRUN_EXIT"; fi
trap 'exit 124' USR1
echo $$ > "$FAKE_LOG/srun_pid"
while true; do sleep 0.1; done
"""


def run_sbatch(tmp_path, srun_exit=None, signal_after_start=False):
    log = tmp_path / "log"
    log.mkdir(parents=True)
    env = fake_commands(tmp_path / "bin", srun=FAKE_SRUN,
                        scontrol='echo "$@" >> "$FAKE_LOG/scontrol"',
                        scancel='echo "$@" >> "$FAKE_LOG/scancel"; kill -USR1 "$(cat "$FAKE_LOG/srun_pid")"')
    env.update(FAKE_LOG=str(log), SLURM_JOB_ID="4242", SLURM_NNODES="2", SLURM_SUBMIT_DIR=str(ROOT),
               SLURM_GPUS_ON_NODE="8", SLURM_CPUS_PER_TASK="16")
    if srun_exit is not None:
        env["FAKE_SRUN_EXIT"] = str(srun_exit)
    proc = subprocess.Popen(["bash", "slurm/train.sbatch", "recipes/tiny.yaml", "out_dir=runs/x"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if signal_after_start:
        deadline = time.time() + 30
        while not (log / "srun_pid").exists() and time.time() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGUSR1)  # what `#SBATCH --signal=B:USR1@300` does
    out, err = proc.communicate(timeout=60)
    read = lambda name: (log / name).read_text() if (log / name).exists() else ""  # noqa: E731
    return proc.returncode, err, read("srun_args"), read("scontrol"), read("scancel")


def test_sbatch_forwards_the_time_limit_signal_and_requeues(tmp_path):
    code, err, srun_args, scontrol, scancel = run_sbatch(tmp_path, signal_after_start=True)
    assert scancel.split() == ["--signal=USR1", "4242"]
    assert scontrol.split() == ["requeue", "4242"]
    assert code == 0, err
    assert srun_args.split() == ["--ntasks-per-node=1", "--cpus-per-task=16", "--kill-on-bad-exit=1", "bash",
                                 "slurm/launch.sh", "recipes/tiny.yaml", "out_dir=runs/x"]


def test_sbatch_requeues_on_exit_124_but_not_on_a_crash(tmp_path):
    code, _, _, scontrol, _ = run_sbatch(tmp_path / "preempted", srun_exit=124)
    assert code == 0 and scontrol.split() == ["requeue", "4242"]
    code, _, _, scontrol, _ = run_sbatch(tmp_path / "crashed", srun_exit=1)
    assert code == 1 and scontrol == ""
    code, _, _, scontrol, _ = run_sbatch(tmp_path / "finished", srun_exit=0)
    assert code == 0 and scontrol == ""


def start_node(args: list[str], env: dict) -> subprocess.Popen:
    """slurm/launch.sh in a process group of its own, so a failed test can stop it and its launcher."""
    return subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def stop_nodes(procs: list[subprocess.Popen]) -> None:
    """SIGTERM reaches the launcher, which stops its workers (they run in sessions of their own); then SIGKILL."""
    running = [p for p in procs if p.poll() is None]
    for proc in running:
        os.killpg(proc.pid, signal.SIGTERM)
    for proc in running:
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()


def node_env(node_id: int, port: int) -> dict:
    env = subprocess_env()
    env.update(SLURM_NNODES="2", SLURM_NODEID=str(node_id), SLURM_JOB_NODELIST="127.0.0.1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), GPUS_PER_NODE="1", PYTHON=sys.executable)
    return env


def losses(out_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


@pytest.mark.slow
def test_two_simulated_nodes_match_one_node(tmp_path, tiny_data):
    overrides = [f"data.path={tiny_data}", *TINY_OVERRIDES, "train.max_steps=3",
                 "distributed.deepspeed_config=ds_configs/zero2.json"]
    two_nodes = tmp_path / "two_nodes"
    port = free_port()
    nodes = [start_node(["bash", "slurm/launch.sh", "recipes/tiny.yaml", f"out_dir={two_nodes}", *overrides], node_env(i, port))
             for i in (0, 1)]
    try:
        outputs = [p.communicate(timeout=600)[0] for p in nodes]
    finally:
        stop_nodes(nodes)
    for i, (proc, out) in enumerate(zip(nodes, outputs)):
        assert proc.returncode == 0, f"node {i}:\n{out[-6000:]}"
        assert f"node {i} of 2" in out

    meta = json.loads((two_nodes / "run_meta.json").read_text())
    assert meta["world_size"] == 2
    # Each rank wrote its own model-state measurement and its own ZeRO-2 optimizer shard.
    assert [json.loads((two_nodes / f"memory_rank{r}.json").read_text())["rank"] for r in (0, 1)] == [0, 1]
    shards = {p.name for p in two_nodes.glob("checkpoints/step_*/**/*optim_states.pt")}
    assert any("zero_pp_rank_0" in s for s in shards) and any("zero_pp_rank_1" in s for s in shards), shards

    one_node = tmp_path / "one_node"
    run_train(one_node, tiny_data, ["train.max_steps=3", "distributed.deepspeed_config=ds_configs/zero2.json"], nproc=2)
    expected, got = losses(one_node), losses(two_nodes)
    assert sorted(got) == [1, 2, 3]
    assert got == pytest.approx(expected, abs=1e-6)


@pytest.mark.slow
def test_usr1_checkpoints_and_the_relaunch_resumes(tmp_path, tiny_data):
    """SIGUSR1 to a node's launch.sh (as SLURM sends it) stops training with a checkpoint and exit 124."""
    out_dir = tmp_path / "run"
    args = ["bash", "slurm/launch.sh", "recipes/tiny.yaml", f"out_dir={out_dir}", f"data.path={tiny_data}",
            *TINY_OVERRIDES, "checkpoint.every_steps=0"]
    env = node_env(0, free_port())
    env.update(SLURM_NNODES="1", GPUS_PER_NODE="2")
    proc = start_node([*args, "train.max_steps=100000"], env)
    try:
        deadline = time.time() + 300
        while time.time() < deadline and proc.poll() is None:
            if (out_dir / "metrics.jsonl").exists() and len(losses(out_dir)) >= 2:
                break
            time.sleep(0.2)
        proc.send_signal(signal.SIGUSR1)  # to launch.sh only, as SLURM signals a step's task
        out = proc.communicate(timeout=300)[0]
    finally:
        stop_nodes([proc])
    assert proc.returncode == 124, out[-6000:]
    stopped_at = int((out_dir / "checkpoints" / "latest").read_text().strip().removeprefix("step_"))
    assert 2 <= stopped_at < 100000

    resumed = subprocess.run([*args, f"train.max_steps={stopped_at + 2}"], cwd=ROOT, env={**env, "MASTER_PORT": str(free_port())},
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-6000:]
    assert json.loads((out_dir / "run_meta.json").read_text())["resumed_from"] is not None
    assert max(losses(out_dir)) == stopped_at + 2
