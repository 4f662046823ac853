"""Faults a real run meets: a second run on the same out_dir, an abandoned continuation, a dead launcher, a full
disk, a bad input under a launcher. Each ends with a clear message or a clean stop, and loses nothing."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import ROOT, TINY_OVERRIDES, launch_cmd, rank_pid, run_script, run_train, subprocess_env

from lmrecipe.checkpoint.storage import LATEST, PREEMPTED_MARKER, step_dir_name
from lmrecipe.errors import EXIT_LOST_PEER
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


# ---------------------------------------------------------------------------------------------- round three


def _one_paragraph(proc: subprocess.CompletedProcess, code: int = 2) -> str:
    """The error paragraph of a clean failure (exit ``code``, no traceback)."""
    assert proc.returncode == code, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, proc.stderr[-3000:]
    return errors[0]


@pytest.fixture
def ids_past_meta(tmp_path, tiny_data) -> Path:
    """A copy of tiny_data whose train.bin holds ids past meta.json's largest, outside the start-up sample."""
    import numpy as np

    from lmrecipe.data.format import sample_blocks

    folder = tmp_path / "ids_past_meta"
    shutil.copytree(tiny_data, folder)
    tokens = np.fromfile(folder / "train.bin", dtype=np.uint16)
    sampled = np.zeros(len(tokens), dtype=bool)
    for start, stop in sample_blocks(len(tokens)):
        sampled[start:stop] = True
    outside = np.flatnonzero(~sampled)
    tokens[outside[::97]] = 60000  # many windows, so the first steps meet one
    tokens.tofile(folder / "train.bin")
    return folder


@pytest.mark.parametrize("case", ["out_dir is a file", "resume past max_steps", "ids past meta mid-run",
                                  "optimizer damaged past its checks"])
def test_bad_input_to_train_is_one_paragraph_and_leaves_nothing_empty(tmp_path, tmp_path_factory, tiny_data, case,
                                                                       request):
    from helpers import STEPS, plain_run

    out, data, overrides = tmp_path / "run", tiny_data, ["train.max_steps=2"]
    if case == "out_dir is a file":
        out.write_text("not a folder")
        expected = "is a file, not a folder"
    elif case == "resume past max_steps":
        source = plain_run(tmp_path_factory, tiny_data) / "checkpoints" / step_dir_name(STEPS)
        overrides.append(f"checkpoint.resume={source}")
        expected = f"is at step {STEPS}, past train.max_steps=2"
    elif case == "ids past meta mid-run":
        data, overrides = request.getfixturevalue("ids_past_meta"), ["train.max_steps=40"]
        expected = "changed or damaged after preparation"
    else:  # a file over CHECKSUM_MAX_BYTES has no sha256: a change inside it shows only when it is loaded
        source = plain_run(tmp_path_factory, tiny_data) / "checkpoints" / step_dir_name(STEPS)
        ckpt = tmp_path / "copy" / step_dir_name(STEPS)
        shutil.copytree(source, ckpt)
        blob = bytearray((ckpt / "optimizer.bin").read_bytes())
        blob[-40:] = bytes(40)  # the zip archive's directory: its tensors' bytes are read without a check
        (ckpt / "optimizer.bin").write_bytes(bytes(blob))
        saved = json.loads((ckpt / "train_state.json").read_text())
        del saved["sha256"]["optimizer.bin"]
        (ckpt / "train_state.json").write_text(json.dumps(saved))
        overrides = [f"train.max_steps={STEPS + 1}", f"checkpoint.resume={ckpt}"]  # the same rate: the floor
        expected = f"Loading checkpoint {ckpt} failed"
    message = _one_paragraph(run_train(out, data, overrides, check=False))
    assert expected in message
    if case == "out_dir is a file":
        assert out.read_text() == "not a folder"
    elif case == "resume past max_steps":
        assert not out.exists()  # the failed start removed the folders it made


def sigint_as_in_a_terminal() -> None:
    """In the child before exec: SIGINT handled by default, as in a terminal's foreground process (a test run started
    in the background passes SIGINT ignored to its children, and the recipe leaves an ignored SIGINT ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_saves_a_checkpoint_and_exits_130(tmp_path, tiny_data):
    out = tmp_path / "run"
    args = ["train.py", "recipes/tiny.yaml", f"out_dir={out}", f"data.path={tiny_data}", *TINY_OVERRIDES,
            "train.max_steps=100000", "checkpoint.every_steps=0", "train.eval_every_steps=0"]
    proc = subprocess.Popen(launch_cmd(1) + args, cwd=ROOT, env=subprocess_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=sigint_as_in_a_terminal)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and len(train_steps(out)) < 3:
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130 and "Traceback" not in stderr, stderr[-3000:]
    assert "Stopped by SIGINT" in stderr and "Ctrl-C: finishing this step" in stderr
    saved = out / "checkpoints" / (out / "checkpoints" / LATEST).read_text().strip()
    assert json.loads((saved / "train_state.json").read_text())["state"]["step"] >= 3


SECOND_CTRL_C = """
import sys, time
from lmrecipe.train.callbacks.preemption import PreemptionSignal
stop = PreemptionSignal(launched=False)
print("ready", flush=True)
time.sleep(60)
sys.exit(0)
"""


def test_a_second_ctrl_c_stops_at_once():
    proc = subprocess.Popen([sys.executable, "-c", SECOND_CTRL_C], cwd=ROOT, env=subprocess_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=sigint_as_in_a_terminal)
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGINT)
        time.sleep(1.5)  # a human's second press, not the launcher forwarding the first
        start = time.time()
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=10)
    finally:
        proc.kill()
    assert proc.returncode == 130 and time.time() - start < 5
    assert "Second Ctrl-C: stopping now" in stderr and "Traceback" not in stderr


def test_a_run_started_without_a_launcher_outlives_its_shell(tmp_path, tiny_data):
    """`nohup python train.py ... &`, then the shell exits: the run goes on to its last step."""
    out = tmp_path / "run"
    cmd = " ".join([shlex.quote(sys.executable), "train.py", "recipes/tiny.yaml", f"out_dir={out}",
                    f"data.path={tiny_data}", *TINY_OVERRIDES, "train.max_steps=30", "checkpoint.every_steps=0",
                    "train.eval_every_steps=0"])
    # The shell starts training in the background, waits for its first step, and exits.
    shell = f"{cmd} > {out}.log 2>&1 & while [ ! -s {out}/metrics.jsonl ]; do sleep 0.1; done"
    subprocess.run(["bash", "-c", shell], cwd=ROOT, env=subprocess_env(), timeout=120, check=True)
    deadline = time.time() + 120
    while time.time() < deadline and _ranks_alive(out):
        time.sleep(0.2)
    log = Path(f"{out}.log").read_text()
    assert "Stopped by" not in log, log[-3000:]
    assert train_steps(out)[-1] == 30 and (out / "final.json").is_file()


@pytest.fixture
def disk_of(tmp_path):
    """Real small filesystems (tmpfs) of a given size, unmounted at the end (needs root)."""
    mounts = []

    def mount(size: str) -> Path:
        point = tmp_path / f"disk{len(mounts)}"
        point.mkdir()
        if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(point)],
                                                       check=False).returncode:
            pytest.skip("mounting a small tmpfs needs root")
        mounts.append(point)
        return point

    yield mount
    for point in mounts:
        subprocess.run(["umount", "-l", str(point)], check=False)


def test_full_disk_during_a_background_checkpoint_write(disk_of, tiny_data):
    disk = disk_of("4m")
    out = disk / "run"
    proc = run_train(out, tiny_data, ["train.max_steps=40", "checkpoint.every_steps=2", "checkpoint.keep_last=10",
                                      "train.eval_every_steps=0", "checkpoint.background_save=true"], check=False)
    message = _one_paragraph(proc)
    root = out / "checkpoints"
    latest = root / (root / LATEST).read_text().strip()
    assert "No space left on the device while writing checkpoint" in message and f"{latest} is intact" in message
    assert not [p for p in root.iterdir() if p.name.startswith(".")]  # no temporary folder, no marker
    assert shutil.disk_usage(disk).free > 400_000  # what the failed write took was given back
    assert not (out / LOCK_FILE).exists()


def test_full_disk_when_exporting_and_preparing_leaves_nothing_half_written(disk_of, tiny_data, corpus_dir):
    from lmrecipe.data.prepare.pipeline import prepare
    from lmrecipe.errors import UserError
    from lmrecipe.export import export_checkpoint

    disk = disk_of("2m")
    out = disk / "run"
    proc = run_train(out, tiny_data, ["train.max_steps=2", "checkpoint.every_steps=0", "train.eval_every_steps=0",
                                      "checkpoint.export_at_end=true", "checkpoint.export_dtype=fp32"], check=False)
    ckpt = out / "checkpoints" / step_dir_name(2)
    message = _one_paragraph(proc)
    assert "No space left on the device while exporting" in message and f"tools/export_hf.py {ckpt}" in message
    assert (ckpt / "train_state.json").is_file() and not (out / "export").exists()
    free = shutil.disk_usage(disk).free
    occupied = disk / "occupied"
    occupied.mkdir()
    (occupied / "keep.txt").write_text("the previous output")
    for dest, overwrite in ((disk / "export", False), (occupied, True)):
        with pytest.raises(UserError, match="No space left on the device while exporting"):
            export_checkpoint(ckpt, dest, dtype="fp32", overwrite=overwrite)
    for dest, overwrite in ((disk / "data", False), (occupied, True)):
        with pytest.raises(UserError, match="No space left on the device while writing"):
            prepare(output=dest, inputs=[corpus_dir], vocab_size=384, num_proc=1, overwrite=overwrite)
    assert sorted(p.name for p in disk.iterdir()) == ["occupied", "run"]
    assert [p.name for p in occupied.iterdir()] == ["keep.txt"]
    assert shutil.disk_usage(disk).free >= free - 8192  # no temporary left behind


def test_eval_refuses_other_tokenizers_data_and_an_output_under_a_file(tmp_path, tmp_path_factory, tiny_data, corpus_dir):
    from helpers import plain_run

    from lmrecipe.data.prepare.pipeline import prepare
    from lmrecipe.errors import UserError
    from lmrecipe.evaluation.evaluate import evaluate_path

    export = plain_run(tmp_path_factory, tiny_data) / "export"
    other = tmp_path / "other"
    prepare(output=other, inputs=sorted(corpus_dir.iterdir())[:10], vocab_size=384, val_fraction=0.2, num_proc=1)
    with pytest.raises(UserError, match="prepared with another tokenizer"):
        evaluate_path(export, other, max_batches=1)
    result, _ = evaluate_path(export, other, max_batches=1, allow_other_tokenizer=True)
    assert result["tokens"] > 0
    (tmp_path / "taken").write_text("x")
    proc = run_script(["eval.py", str(export), "--data", str(tiny_data), "--output", str(tmp_path / "taken" / "r.json")],
                      check=False)
    assert "lies under" in _one_paragraph(proc) and proc.stdout == ""  # refused before evaluating


@pytest.mark.slow
def test_a_killed_rank_is_named_by_the_survivor(tmp_path, tiny_data):
    out = tmp_path / "run"
    args = ["train.py", "recipes/tiny.yaml", f"out_dir={out}", f"data.path={tiny_data}", *TINY_OVERRIDES,
            "train.max_steps=100000", "checkpoint.every_steps=5", "train.eval_every_steps=0"]
    exit_file = tmp_path / "exit.json"
    launcher = subprocess.Popen(launch_cmd(2) + args, cwd=ROOT, env={**subprocess_env(), "LMRECIPE_EXIT_FILE": str(exit_file)},
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.time() + 300
        while time.time() < deadline and not (out / "checkpoints" / LATEST).is_file():
            time.sleep(0.2)
        rank1 = rank_pid(out, 1)
        os.kill(rank1, signal.SIGKILL)
        _, stderr = launcher.communicate(timeout=120)
    finally:
        if _ranks_alive(out):
            os.killpg(launcher.pid, signal.SIGKILL)
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, stderr[-4000:]
    assert f"rank 1 (pid {rank1}) on {socket.gethostname()} died" in errors[0]
    assert "The last checkpoint is" in errors[0] and "checkpoint.resume=auto" in errors[0]
    assert json.loads(exit_file.read_text())["exit_code"] == EXIT_LOST_PEER  # slurm/train.sbatch may run it again


FAKE_LAUNCH_PYTHON = """#!/usr/bin/env bash
# launch_flags.py: no flags; the launcher: its worker records exit 2 and the launcher reports 1; else real python.
if [[ "$1" == */launch_flags.py ]]; then echo --multi_gpu; exit 0; fi
if [[ "$1" == -m && "$2" == accelerate.commands.launch ]]; then
    echo '{"exit_code": 2, "error": "data.path is wrong. Fix it.", "rank": 0}' > "$LMRECIPE_EXIT_FILE"
    echo "ChildFailedError" >&2
    exit 1
fi
exec "$REAL_PYTHON" "$@"
"""


def test_launch_sh_exits_with_the_training_processes_own_status(tmp_path):
    fake = tmp_path / "python"
    fake.write_text(FAKE_LAUNCH_PYTHON)
    fake.chmod(0o755)
    (tmp_path / "status").mkdir()
    env = {**subprocess_env(), "PYTHON": str(fake), "REAL_PYTHON": sys.executable, "MASTER_ADDR": "127.0.0.1",
           "LMRECIPE_PROCS_PER_NODE": "2", "TMPDIR": str(tmp_path), "LMRECIPE_STATUS_DIR": str(tmp_path / "status"),
           "MACHINE_RANK": "1"}
    proc = subprocess.run(["bash", "slurm/launch.sh", "recipes/tiny.yaml"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].endswith("training exited 2: data.path is wrong. Fix it.")
    assert not list(tmp_path.glob("lmrecipe-exit.*"))  # the status file is removed
    assert (tmp_path / "status" / "node1").read_text() == "2\n"  # the node's outcome, for slurm/train.sbatch


EXIT_PROBE = """
import atexit, sys, threading, time
from pathlib import Path
from lmrecipe.cli import exit_launched

out = Path(sys.argv[1])
def late_write():
    time.sleep(0.3)
    (out / "thread.txt").write_text("joined")
threading.Thread(target=late_write).start()
atexit.register(lambda: (out / "atexit.txt").write_text("ran"))
class Finalised:
    def __del__(self):
        (out / "teardown.txt").write_text("ran")
kept = Finalised()
sys.stdout.write("buffered, no newline")
exit_launched(int(sys.argv[2]))
"""


@pytest.mark.parametrize("world_size, code", [("1", 0), ("2", 0), ("2", 3)])
def test_a_launched_rank_that_succeeds_exits_after_its_threads_and_exit_handlers_without_the_teardown(
        tmp_path, world_size, code):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WORLD_SIZE": world_size}
    proc = subprocess.run([sys.executable, "-c", EXIT_PROBE, str(tmp_path), str(code)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == code, proc.stderr
    assert proc.stdout == "buffered, no newline"
    assert (tmp_path / "thread.txt").read_text() == "joined" and (tmp_path / "atexit.txt").read_text() == "ran"
    # Only a launched rank that succeeded skips the interpreter's teardown (where a rank's gloo threads have aborted).
    assert (tmp_path / "teardown.txt").exists() == (world_size == "1" or code != 0)
