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
from helpers import ROOT, STEPS, TINY_OVERRIDES, free_port, run_train, subprocess_env, zero_pair

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
    assert {p.name for p in SCRIPTS} >= {"launch.sh", "topology.sh", "train.sbatch", "compare_zero.sbatch"}
    # -x follows `source slurm/topology.sh`, so the sourced functions are checked where they are used.
    proc = subprocess.run([str(shellcheck), "--shell=bash", "-x", *map(str, SCRIPTS)], cwd=ROOT, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# A stand-in scontrol: gpu-[a-d] expands to gpu-a..gpu-d, cpu-[a-b] to cpu-a, cpu-b; gpu-a's address is 10.1.2.3
# (its name need not resolve), cpu-a has none.
FAKE_SCONTROL = """
if [[ "$1 $2 $3" == "show hostnames gpu-[a-d]" ]]; then printf "gpu-a\\ngpu-b\\ngpu-c\\ngpu-d\\n"; fi
if [[ "$1 $2 $3" == "show hostnames cpu-[a-b]" ]]; then printf "cpu-a\\ncpu-b\\n"; fi
if [[ "$*" == "-o show node gpu-a" ]]; then echo "NodeName=gpu-a Arch=x86_64 NodeAddr=10.1.2.3 NodeHostName=gpu-a Port=0"; fi
if [[ "$*" == "-o show node cpu-a" ]]; then exit 1; fi
"""


def dry_run(tmp_path, overrides, **env_vars) -> subprocess.CompletedProcess:
    env = fake_commands(tmp_path / "bin", scontrol=FAKE_SCONTROL)
    for key in ("OMP_NUM_THREADS", "LMRECIPE_PROCS_PER_NODE", "SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE",
                "SLURM_CPUS_PER_TASK", "SLURM_CPUS_ON_NODE"):
        env.pop(key, None)
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
    assert flags["--main_process_ip"] == "10.1.2.3"  # NodeAddr of the first host of the expanded node list
    assert flags["--main_process_port"] == str(20000 + 123456 % 20000)
    assert flags["--num_processes"] == "32"  # 4 nodes x 8 GPUs
    assert flags["--deepspeed_multinode_launcher"] == "standard" and "--use_deepspeed" in cmd
    # The recipe and overrides pass through untouched, after the training script.
    assert cmd[cmd.index(str(ROOT / "train.py")) + 1:] == [
        "recipes/tiny.yaml", "distributed.deepspeed_config=ds_configs/zero2.json", "optim.lr=1e-3"]


def test_launch_without_deepspeed_uses_multi_gpu(tmp_path):
    proc = dry_run(tmp_path, [], MASTER_ADDR="10.0.0.7", MASTER_PORT="29999", SLURM_NNODES="2", SLURM_NODEID="0",
                   LMRECIPE_PROCS_PER_NODE="4")
    assert proc.returncode == 0, proc.stderr
    cmd = proc.stdout.split()
    assert "--multi_gpu" in cmd and "--use_deepspeed" not in cmd
    assert "10.0.0.7" in cmd and "29999" in cmd and cmd[cmd.index("--num_processes") + 1] == "8"


@pytest.mark.parametrize("gpus", [None, "0"], ids=["no-gpus", "gpus-per-node-0"])
def test_launch_on_cpu_nodes(tmp_path, gpus):
    """No GPUs (or --gpus-per-node=0): one process per node with the node's CPUs as threads, not 0 processes."""
    env = dict(SLURM_JOB_NODELIST="cpu-[a-b]", SLURM_NNODES="2", SLURM_NODEID="1", SLURM_CPUS_ON_NODE="16")
    if gpus is not None:
        env["SLURM_GPUS_PER_NODE"] = gpus
    proc = dry_run(tmp_path, [], **env)
    assert proc.returncode == 0, proc.stderr
    cmd = proc.stdout.split()
    assert cmd[cmd.index("--num_processes") + 1] == "2" and "--multi_gpu" in cmd
    assert "1 processes per node x 16 threads" in proc.stderr
    assert cmd[cmd.index("--main_process_ip") + 1] == "cpu-a"  # no NodeAddr from scontrol: the node name

    explicit = dry_run(tmp_path, [], **env, LMRECIPE_PROCS_PER_NODE="4")
    assert explicit.returncode == 0, explicit.stderr
    assert explicit.stdout.split()[explicit.stdout.split().index("--num_processes") + 1] == "8"
    assert "4 processes per node x 4 threads" in explicit.stderr

    # A single process in all: Accelerate refuses --multi_gpu for one process, so it is left out.
    single = dry_run(tmp_path, [], SLURM_JOB_NODELIST="cpu-[a-b]", SLURM_NNODES="1", SLURM_GPUS_PER_NODE="0")
    assert single.returncode == 0, single.stderr
    assert "--multi_gpu" not in single.stdout.split() and "--num_processes 1 " in single.stdout


@pytest.mark.parametrize("value", ["0", "two", "-1"])
def test_launch_rejects_a_bad_process_count(tmp_path, value):
    proc = dry_run(tmp_path, [], MASTER_ADDR="127.0.0.1", LMRECIPE_PROCS_PER_NODE=value)
    assert proc.returncode == 2
    assert f"LMRECIPE_PROCS_PER_NODE={value}" in proc.stderr and "accelerate" not in proc.stdout


def test_launch_rejects_a_bad_recipe_before_launching(tmp_path):
    proc = dry_run(tmp_path, ["optim.lr_typo=1"], MASTER_ADDR="127.0.0.1")
    assert proc.returncode == 2
    assert "Unknown config key optim.lr_typo" in proc.stderr and "Traceback" not in proc.stderr
    assert "accelerate" not in proc.stdout


# A stand-in srun: records its arguments, then exits with FAKE_SRUN_EXIT, or (after FAKE_STEP_DELAY seconds,
# the time SLURM takes to start the step) waits for SIGUSR1 and exits 124 the way the training step does after
# saving a checkpoint. The stand-in squeue lists the step once it has started.
FAKE_SRUN = """
echo "$@" > "$FAKE_LOG/srun_args"
if [[ -n "${FAKE_SRUN_EXIT:-}" ]]; then exit "$FAKE_SRUN_EXIT"; fi
touch "$FAKE_LOG/srun_started"
sleep "${FAKE_STEP_DELAY:-0}"
trap 'exit 124' USR1
echo $$ > "$FAKE_LOG/srun_pid"
while true; do sleep 0.1; done
"""
FAKE_SQUEUE = """
echo "$SLURM_JOB_ID.batch"
if [[ -e "$FAKE_LOG/srun_pid" ]]; then echo "$SLURM_JOB_ID.0"; fi
"""


def run_sbatch(tmp_path, srun_exit=None, signal_after_start=False, signal_before_step=False, cpus_per_task="16"):
    log = tmp_path / "log"
    log.mkdir(parents=True)
    env = fake_commands(tmp_path / "bin", srun=FAKE_SRUN, squeue=FAKE_SQUEUE,
                        scontrol='echo "$@" >> "$FAKE_LOG/scontrol"',
                        scancel='echo "$@" >> "$FAKE_LOG/scancel"; kill -USR1 "$(cat "$FAKE_LOG/srun_pid")"')
    env.update(FAKE_LOG=str(log), SLURM_JOB_ID="4242", SLURM_NNODES="2", SLURM_SUBMIT_DIR=str(ROOT),
               SLURM_GPUS_ON_NODE="8", LMRECIPE_STATUS_DIR=str(tmp_path / "status"))
    env.pop("SLURM_CPUS_PER_TASK", None)
    if cpus_per_task:
        env["SLURM_CPUS_PER_TASK"] = cpus_per_task
    if srun_exit is not None:
        env["FAKE_SRUN_EXIT"] = str(srun_exit)
    if signal_before_step:
        env["FAKE_STEP_DELAY"] = "1.5"
    proc = subprocess.Popen(["bash", "slurm/train.sbatch", "recipes/tiny.yaml", "out_dir=runs/x"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    if signal_after_start or signal_before_step:
        deadline = time.time() + 30
        marker = log / ("srun_started" if signal_before_step else "srun_pid")
        while not marker.exists() and time.time() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGUSR1)  # what `#SBATCH --signal=B:USR1@300` does
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # with the stand-in srun: a lost stop would leave both running
        out, err = proc.communicate()
        err += "\n(killed after 60 s)"
    read = lambda name: (log / name).read_text() if (log / name).exists() else ""  # noqa: E731
    return proc.returncode, err, read("srun_args"), read("scontrol"), read("scancel")


def test_sbatch_forwards_the_time_limit_signal_and_requeues(tmp_path):
    code, err, srun_args, scontrol, scancel = run_sbatch(tmp_path, signal_after_start=True)
    assert scancel.split() == ["--signal=USR1", "4242"]
    assert scontrol.split() == ["requeue", "4242"]
    assert code == 0, err
    assert srun_args.split() == ["--ntasks-per-node=1", "--cpus-per-task=16", "--kill-on-bad-exit=1", "bash",
                                 "slurm/launch.sh", "recipes/tiny.yaml", "out_dir=runs/x"]


def test_sbatch_keeps_a_stop_that_arrives_before_the_job_step_exists(tmp_path):
    """SIGUSR1 while srun is still starting its step: forwarded once squeue lists the step, then requeue."""
    code, err, srun_args, scontrol, scancel = run_sbatch(tmp_path, signal_before_step=True, cpus_per_task=None)
    assert scancel.split() == ["--signal=USR1", "4242"]  # once, when the step could receive it
    assert scontrol.split() == ["requeue", "4242"]
    assert code == 0, err
    assert "--whole" in srun_args.split()  # no --cpus-per-task given: the step gets all of the job's CPUs


def test_sbatch_requeues_on_exit_124_but_not_on_a_crash(tmp_path):
    code, _, _, scontrol, _ = run_sbatch(tmp_path / "preempted", srun_exit=124)
    assert code == 0 and scontrol.split() == ["requeue", "4242"]
    code, _, _, scontrol, _ = run_sbatch(tmp_path / "crashed", srun_exit=1)
    assert code == 1 and scontrol == ""
    code, _, _, scontrol, _ = run_sbatch(tmp_path / "finished", srun_exit=0)
    assert code == 0 and scontrol == ""


# A stand-in srun for the runs of the training step: its Nth run takes line N of $FAKE_STEPS, "SRUN_EXIT CODE0
# CODE1" (each node's outcome, as slurm/launch.sh writes it; "-": the node wrote none), and logs the restart it was
# given.
FAKE_SRUN_STEPS = """
echo "${LMRECIPE_JOB_RESTART:-0} ${LMRECIPE_JOB_RESTART_REASON:-}" >> "$FAKE_LOG/runs"
read -r code nodes <<< "$(sed -n "$(wc -l < "$FAKE_LOG/runs")p" "$FAKE_STEPS")"
i=0
for node in $nodes; do
    [[ $node == - ]] || echo "$node" > "$LMRECIPE_STATUS_DIR/node$i"
    i=$((i + 1))
done
exit "$code"
"""


def run_sbatch_steps(tmp_path, steps: list[str], **env_vars) -> tuple[int, str, list[str], str]:
    """slurm/train.sbatch over the stand-in runs ``steps``: its exit code, stderr, each run's restart, scontrol's log."""
    log = tmp_path / "log"
    log.mkdir(parents=True)
    (tmp_path / "steps").write_text("\n".join(steps) + "\n")
    env = fake_commands(tmp_path / "bin", srun=FAKE_SRUN_STEPS, scontrol='echo "$@" >> "$FAKE_LOG/scontrol"')
    env.update(FAKE_LOG=str(log), FAKE_STEPS=str(tmp_path / "steps"), SLURM_JOB_ID="4242", SLURM_NNODES="2",
               SLURM_SUBMIT_DIR=str(ROOT), SLURM_CPUS_PER_TASK="2", LMRECIPE_STATUS_DIR=str(tmp_path / "status"),
               **env_vars)
    proc = subprocess.run(["bash", "slurm/train.sbatch", "recipes/tiny.yaml", "out_dir=runs/x"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    runs = (log / "runs").read_text().splitlines() if (log / "runs").exists() else []
    scontrol = (log / "scontrol").read_text() if (log / "scontrol").exists() else ""
    assert not (tmp_path / "status").exists()  # removed when the script ends
    return proc.returncode, proc.stderr, runs, scontrol


def test_sbatch_runs_the_step_again_after_a_hang_or_a_lost_peer(tmp_path):
    """A hang on node 0 (node 1 stopped by srun: 124), a lost peer with node 1 killed before it wrote anything, a hang
    whose frozen rank was killed (node 1's processes ended without a record), then success."""
    code, err, runs, scontrol = run_sbatch_steps(tmp_path, ["124 3 124", "137 4 -", "1 3 killed", "0 0 0"],
                                                 LMRECIPE_RESTARTS="3")
    assert code == 0 and scontrol == "", err
    assert runs == ["0 ", "1 a hang", "2 a lost peer", "3 a hang"]
    assert "ended after a hang (exit 124); running it again in this allocation" in err


def test_sbatch_never_runs_a_crash_or_a_bad_input_again(tmp_path):
    code, err, runs, scontrol = run_sbatch_steps(tmp_path / "crash", ["124 1 4"])  # node 0 crashed, node 1 lost it
    assert (code, runs, scontrol) == (1, ["0 "], ""), err
    code, err, runs, scontrol = run_sbatch_steps(tmp_path / "input", ["2 2 2"])
    assert (code, runs, scontrol) == (2, ["0 "], ""), err
    code, err, runs, scontrol = run_sbatch_steps(tmp_path / "unrecorded", ["1 killed killed"])  # no hang, no lost peer
    assert (code, runs, scontrol) == (1, ["0 "], ""), err


def test_sbatch_stops_after_its_restarts_and_still_requeues_a_preemption(tmp_path):
    code, err, runs, scontrol = run_sbatch_steps(tmp_path / "out", ["4 4 4"] * 3, LMRECIPE_RESTARTS="1")
    assert (code, runs, scontrol) == (4, ["0 ", "1 a lost peer"], ""), err
    assert "LMRECIPE_RESTARTS=1 runs used" in err
    code, err, runs, scontrol = run_sbatch_steps(tmp_path / "preempted", ["124 124 124"])
    assert (code, runs, scontrol.split()) == (0, ["0 "], ["requeue", "4242"]), err
    code, err, runs, _ = run_sbatch_steps(tmp_path / "bad", ["0 0 0"], LMRECIPE_RESTARTS="two")
    assert code == 2 and runs == [] and "LMRECIPE_RESTARTS=two must be a whole number" in err


# Stand-ins for the launch of training: `python tools/launch_flags.py` (slow when FAKE_FLAGS_DELAY is set) and
# `python -m accelerate.commands.launch`, whose child plays a training process: SIGUSR1 stays ignored (inherited
# from the launcher) through a start-up of FAKE_STARTUP seconds, then it installs a handler, like lmrecipe's
# trainer, and exits 124 when the signal comes (0 after 20 s without one).
FAKE_WORKER = """
import os, signal, sys, time
time.sleep(float(os.environ["FAKE_STARTUP"]))
got = []
signal.signal(signal.SIGUSR1, lambda *_: got.append(1))
open(os.path.join(os.environ["FAKE_LOG"], "handler_installed"), "w").close()
deadline = time.time() + 20
while not got and time.time() < deadline:
    time.sleep(0.05)
sys.exit(124 if got else 0)
"""
FAKE_PYTHON = """
if [[ "$1" == */launch_flags.py ]]; then
    touch "$FAKE_LOG/flags_started"
    sleep "${FAKE_FLAGS_DELAY:-0}"
    echo --multi_gpu
    exit 0
fi
touch "$FAKE_LOG/launcher_started"
"$REAL_PYTHON" -c "$FAKE_WORKER"
"""


@pytest.mark.parametrize("when", ["before_launcher", "during_worker_start_up"])
def test_launch_keeps_a_stop_that_arrives_during_start_up(tmp_path, when):
    """A SIGUSR1 before the training processes can take it is not lost: it reaches them once their handler is
    installed (exit 124 after a checkpoint), or, before the launcher runs, stops the node at once (exit 124)."""
    log = tmp_path / "log"
    log.mkdir()
    env = fake_commands(tmp_path / "bin", python=FAKE_PYTHON)
    env.update(PYTHON=str(tmp_path / "bin" / "python"), REAL_PYTHON=sys.executable, FAKE_WORKER=FAKE_WORKER,
               FAKE_LOG=str(log), FAKE_STARTUP="1.5", MASTER_ADDR="127.0.0.1", LMRECIPE_PROCS_PER_NODE="2")
    if when == "before_launcher":
        env["FAKE_FLAGS_DELAY"] = "1.5"
    proc = start_node(["bash", "slurm/launch.sh", "recipes/tiny.yaml"], env)
    marker = log / ("flags_started" if when == "before_launcher" else "launcher_started")
    deadline = time.time() + 30
    while not marker.exists() and time.time() < deadline:
        time.sleep(0.02)
    time.sleep(0.3)
    assert not (log / "handler_installed").exists()  # the signal comes before the worker could take it
    start = time.time()
    proc.send_signal(signal.SIGUSR1)
    try:
        out = proc.communicate(timeout=60)[0]
    finally:
        stop_nodes([proc])
    assert proc.returncode == 124, out
    assert time.time() - start < 10  # not the worker's 20 s wait: the stop reached it
    assert (log / "launcher_started").exists() == (when == "during_worker_start_up")


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
               MASTER_PORT=str(port), LMRECIPE_PROCS_PER_NODE="1", PYTHON=sys.executable)
    return env


def losses(out_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


@pytest.mark.slow
def test_two_simulated_nodes_match_one_node(tmp_path, tmp_path_factory, tiny_data):
    """Two nodes of one process each, launched by slurm/launch.sh, train as the session's 2-process ZeRO-2 run on one
    node (``zero_pair``'s run ``a``: the same steps and schedule; its checkpoints and instruments change no loss)."""
    one_node = zero_pair(tmp_path_factory, tiny_data, 2)["a"]
    overrides = [f"data.path={tiny_data}", *TINY_OVERRIDES, f"train.max_steps={STEPS}",
                 "distributed.deepspeed_config=ds_configs/zero2.json", "logging.measure_model_states=true"]
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

    expected, got = losses(one_node), losses(two_nodes)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert got == pytest.approx(expected, abs=1e-6)


@pytest.mark.slow
def test_usr1_checkpoints_and_the_relaunch_resumes(tmp_path, tiny_data):
    """SIGUSR1 to a node's launch.sh (as SLURM sends it) stops training with a checkpoint and exit 124."""
    out_dir = tmp_path / "run"
    args = ["bash", "slurm/launch.sh", "recipes/tiny.yaml", f"out_dir={out_dir}", f"data.path={tiny_data}",
            *TINY_OVERRIDES, "checkpoint.every_steps=0", "schedule.decay=constant"]  # the resume shortens the run
    env = node_env(0, free_port())
    env.update(SLURM_NNODES="1", LMRECIPE_PROCS_PER_NODE="2")
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
