"""The training loop end to end: metrics, schedule, skips, and the ZeRO matrix on 2 CPU processes."""

from __future__ import annotations

import importlib.metadata
import json
import math

import pytest
from helpers import TINY_OVERRIDES, plain_run, run_train, zero_pair

from lmrecipe.config import load_config
from lmrecipe.observe.metrics_log import read_metrics
from lmrecipe.optim import lr_at

STEPS = 6
REQUIRED_KEYS = {"step", "tokens_seen", "loss", "lr", "grad_norm", "tokens_per_sec", "mfu", "step_time_s", "data_time_s", "peak_mem_gb"}


def train_rows(out_dir):
    return [r for r in read_metrics(out_dir / "metrics.jsonl") if "loss" in r]


def val_rows(out_dir):
    return [r for r in read_metrics(out_dir / "metrics.jsonl") if "val_loss" in r]


def assert_losses_match(a: list[dict], b: list[dict], rel: float) -> float:
    assert [r["step"] for r in a] == [r["step"] for r in b]
    worst = 0.0
    for ra, rb in zip(a, b):
        diff = abs(ra["loss"] - rb["loss"]) / abs(rb["loss"])
        worst = max(worst, diff)
        assert diff <= rel, (ra["step"], ra["loss"], rb["loss"])
    return worst


# ---------------------------------------------------------------------------------------------- end to end


def test_single_process_run_learns_and_reports(tmp_path, tiny_data):
    out = tmp_path / "run"
    proc = run_train(out, tiny_data, ["train.max_steps=40", "train.eval_every_steps=20", "logging.log_every_steps=5",
                                      "optim.lr=3e-3", "logging.plots=true", "logging.peak_tflops=null"], env_extra={"PYTHONPROFILEIMPORTTIME": "1"})
    # A run without DeepSpeed never imports it (about 1.2 s of every such process's start); it still records its version.
    assert not [line for line in proc.stderr.splitlines() if line.startswith("import time:") and "| deepspeed" in line]
    rows = train_rows(out)
    assert rows and REQUIRED_KEYS <= rows[0].keys()
    assert [r["step"] for r in rows] == [1, 5, 10, 15, 20, 25, 30, 35, 40]
    assert [r["tokens_seen"] for r in rows] == [r["step"] * 8 * 32 for r in rows]
    cfg = load_config("recipes/tiny.yaml", [f"data.path={tiny_data}", *TINY_OVERRIDES, "train.max_steps=40", "optim.lr=3e-3"])
    for r in rows:  # the schedule is stepped exactly once per optimizer step
        assert r["lr"] == pytest.approx(lr_at(r["step"] - 1, 40, cfg.optim, cfg.schedule))
    assert all(math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0 and 0 < r["mfu"] < 5 for r in rows)
    vals = val_rows(out)
    assert [v["step"] for v in vals] == [20, 40]
    assert vals[-1]["val_ppl"] == pytest.approx(math.exp(vals[-1]["val_loss"]))
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.5
    assert (out / "training.png").stat().st_size > 10_000
    meta = json.loads((out / "run_meta.json").read_text())
    assert meta["world_size"] == 1 and meta["precision"] == "fp32" and meta["config"]["train"]["max_steps"] == 40
    assert meta["versions"]["deepspeed"] == importlib.metadata.version("deepspeed")
    assert meta["peak_tflops_source"].startswith("matmul probe") and meta["peak_tflops_per_device"] > 0
    assert (out / "config.yaml").is_file()


def test_divergence_stops_with_advice(tmp_path, tiny_data):
    out = tmp_path / "run"
    proc = run_train(out, tiny_data, ["train.max_steps=30", "optim.lr=1e6", "schedule.warmup_steps=0", "optim.grad_clip=0",
                                      "train.max_consecutive_skips=3"], check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "consecutive updates were skipped" in proc.stderr and "optim.lr" in proc.stderr
    assert "Traceback" not in proc.stderr
    rows = train_rows(out)
    assert rows[-1]["skipped_steps"] == 3 and rows[-1]["step"] < 30


# ---------------------------------------------------------------------------------------------- the ZeRO matrix

BACKENDS = ["none", "zero1", "zero2", "zero3", "zero2_offload", "zero3_offload"]


# The session's shared runs of a layout train the same steps (their checkpoints, evaluations and per-layer
# instruments change no loss): the matrix reads them instead of training the layout again.
SHARED_RUNS = {("none", 1): plain_run, ("zero2", 2): lambda factory, data: zero_pair(factory, data, 2)["a"]}


@pytest.fixture(scope="module")
def matrix(tmp_path_factory, tiny_data):
    """Runs on demand and caches: backend name -> metrics rows of a 2-process fp32 run of STEPS steps."""
    root = tmp_path_factory.mktemp("matrix")
    cache: dict[str, list[dict]] = {}

    def get(name: str, nproc: int = 2, extra: tuple[str, ...] = ()) -> list[dict]:
        key = f"{name}-{nproc}-{'-'.join(extra)}"
        if key not in cache:
            ds = "null" if name == "none" else f"ds_configs/{name}.json"
            out = root / key.replace("=", "_").replace(".", "_")
            if (name, nproc) in SHARED_RUNS and not extra:
                out = SHARED_RUNS[name, nproc](tmp_path_factory, tiny_data)
            else:
                run_train(out, tiny_data, [f"train.max_steps={STEPS}", f"distributed.deepspeed_config={ds}", *extra],
                          nproc=nproc)
            cache[key] = train_rows(out)
            assert len(cache[key]) == STEPS
        return cache[key]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_two_processes_complete_and_agree_with_no_deepspeed(matrix, backend):
    rows = matrix(backend)
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert all(math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0 for r in rows)  # pre-clip norm on every backend
    if backend != "none":
        assert_losses_match(rows, matrix("none"), rel=1e-3)
        for a, b in zip(rows, matrix("none")):
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-3)


@pytest.mark.slow
def test_processes_and_accumulation_are_interchangeable(matrix):
    # 2 processes x accumulation 1 == 1 process x accumulation 2 at global batch 8 (micro-batch 4).
    assert_losses_match(matrix("none", nproc=2), matrix("none", nproc=1), rel=1e-3)
    assert_losses_match(matrix("zero2", nproc=2), matrix("zero2", nproc=1), rel=1e-3)


@pytest.mark.slow
def test_gradient_checkpointing_under_zero3_gives_the_same_losses(matrix):
    plain = matrix("zero3")
    checkpointed = matrix("zero3", extra=("train.gradient_checkpointing=true",))
    assert_losses_match(checkpointed, plain, rel=1e-3)
