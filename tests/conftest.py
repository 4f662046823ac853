"""Shared fixtures: a tiny prepared dataset and helpers that launch real training processes."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# A small, fast model for every end-to-end test; recipes/tiny.yaml supplies the rest.
TINY_OVERRIDES = [
    "model.hidden_size=64",
    "model.num_layers=2",
    "model.num_heads=4",
    "model.intermediate_size=128",
    "data.seq_len=32",
    "data.val_windows=16",
    "train.global_batch_size=8",
    "train.micro_batch_size=4",
    "schedule.warmup_steps=2",
    "logging.log_every_steps=1",
    "logging.progress_bar=false",
    "checkpoint.export_at_end=false",
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def subprocess_env() -> dict:
    env = dict(os.environ)
    env.pop("WANDB_API_KEY", None)
    env.update(
        PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", WANDB_MODE="offline",
        ACCELERATE_DISABLE_RICH="1", PYTHONUNBUFFERED="1",
    )
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def launch_cmd(nproc: int) -> list[str]:
    """The command a user types: accelerate launch for several processes, plain python for one."""
    if nproc == 1:
        return [sys.executable]
    return [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(nproc),
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port()),
    ]


def run_script(args: list[str], nproc: int = 1, timeout: int = 600, check: bool = True, env_extra: dict | None = None,
               **kwargs) -> subprocess.CompletedProcess:
    """Run ``train.py``/``eval.py``/a tool on ``nproc`` processes from the repo root and capture its output.

    ``env_extra``: variables added to the environment (fault injection).
    """
    proc = subprocess.run(
        launch_cmd(nproc) + args, cwd=ROOT, env={**subprocess_env(), **(env_extra or {})}, capture_output=True,
        text=True, timeout=timeout, **kwargs
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"{args} exited {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-8000:]}")
    return proc


def run_train(out_dir: Path, data_dir: Path, overrides: list[str] = (), nproc: int = 1, **kwargs) -> subprocess.CompletedProcess:
    args = ["train.py", "recipes/tiny.yaml", f"out_dir={out_dir}", f"data.path={data_dir}", *TINY_OVERRIDES, *overrides]
    return run_script(args, nproc=nproc, **kwargs)


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory) -> Path:
    """About 40 real Python source files: text a tiny model can learn something from."""
    from lmrecipe.prepare import embedded_corpus_files

    out = tmp_path_factory.mktemp("corpus")
    files = [f for f in embedded_corpus_files() if 4_000 < f.stat().st_size < 30_000][:40]
    for i, f in enumerate(files):
        shutil.copy(f, out / f"{i:03d}_{f.name}")
    return out


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory, corpus_dir) -> Path:
    """A prepared dataset (byte-level BPE, vocab 384) shared by the end-to-end tests; treat as read-only."""
    from lmrecipe.prepare import prepare

    out = tmp_path_factory.mktemp("data") / "tiny"
    prepare(output=out, inputs=[corpus_dir], vocab_size=384, val_fraction=0.1, num_proc=1)
    return out


def _truthy_env(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no")


@pytest.fixture(scope="session")
def slurm_cluster():
    """A real two-node SLURM cluster on this machine (tests/slurm_cluster.py), torn down after the session.

    Needs root and Debian's SLURM packages (installed with apt-get when missing). Where that is impossible the
    tests are skipped with the reason; with CI set they fail instead, so CI cannot pass without running them.
    """
    from slurm_cluster import ClusterUnavailable, SlurmCluster

    cluster = SlurmCluster()
    try:
        cluster.start()
    except ClusterUnavailable as exc:
        if _truthy_env("CI"):
            pytest.fail(f"CI is set but no SLURM cluster could be started: {exc}")
        pytest.skip(f"no SLURM cluster: {exc}")
    try:
        yield cluster
    finally:
        cluster.stop()
