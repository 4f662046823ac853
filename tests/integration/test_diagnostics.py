"""Diagnosing a run: profiler, early stopping, determinism, OOM diagnosis, the run report, the container files."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from helpers import run_train
from safetensors.torch import load_file

from lmrecipe.config import load_config
from lmrecipe.data.format import load_meta
from lmrecipe.parallel.topology import ZeroSetup
from lmrecipe.errors import EXIT_USER_ERROR
from lmrecipe.planning.memory import estimate
from lmrecipe.observe.metrics_log import read_metrics
from lmrecipe.observe.profiler import PREFIX
from lmrecipe.planning.shapes import shape_from_config
from lmrecipe.train.callbacks.faults import OOM_FAULT_ENV as FAULT_ENV


def checkpoint_names(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").iterdir() if p.is_dir())


def pointer(out: Path, name: str) -> str:
    return (out / "checkpoints" / name).read_text().strip()


# ---------------------------------------------------------------------------------------------- profiler + report


@pytest.fixture(scope="module")
def profiled_run(tmp_path_factory, tiny_data):
    out = tmp_path_factory.mktemp("profiled")
    proc = run_train(out, tiny_data, ["train.max_steps=5", "train.eval_every_steps=2", "profile.first_step=2",
                                      "profile.last_step=3", "logging.cost_per_device_hour=2.5", "logging.plots=true"])
    return out, proc


@pytest.mark.slow
def test_profiler_writes_a_trace_and_a_breakdown_that_sums_to_one(profiled_run):
    out, _ = profiled_run
    trace = json.loads((out / "profile" / "rank0.pt.trace.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {PREFIX + "step", PREFIX + "forward", PREFIX + "backward", PREFIX + "optimizer", PREFIX + "data"} <= names
    breakdown = json.loads((out / "profile" / "rank0.json").read_text())
    assert breakdown["steps"] == 2
    fractions = breakdown["fractions"]
    assert sum(fractions.values()) == pytest.approx(1.0, abs=1e-6)
    assert fractions["forward"] > 0.05 and fractions["backward"] > 0.05 and fractions["optimizer"] > 0
    assert fractions["communication"] == 0.0  # one process: no collective
    summary = (out / "profile" / "summary.md").read_text()
    assert "optimizer steps 2-3" in summary and "| 0 | 2 |" in summary and "100.0 %" in summary


@pytest.mark.slow
def test_profiler_on_two_processes_reports_every_rank(tmp_path, tiny_data):
    run_train(tmp_path, tiny_data, ["train.max_steps=4", "profile.first_step=2", "profile.last_step=3"], nproc=2)
    for rank in (0, 1):
        fractions = json.loads((tmp_path / "profile" / f"rank{rank}.json").read_text())["fractions"]
        assert sum(fractions.values()) == pytest.approx(1.0, abs=1e-6) and fractions["communication"] > 0
    summary = (tmp_path / "profile" / "summary.md").read_text()
    assert "| 0 | 2 |" in summary and "| 1 | 2 |" in summary


@pytest.mark.slow
def test_report_matches_metrics(profiled_run):
    out, _ = profiled_run
    rows = read_metrics(out / "metrics.jsonl")
    train = [r for r in rows if "loss" in r]
    val = [r["val_loss"] for r in rows if "val_loss" in r]
    best_step = min((r for r in rows if "val_loss" in r), key=lambda r: r["val_loss"])["step"]
    assert all(r["gpu_util_pct"] is None and r["gpu_mem_used_gb"] is None for r in train)  # CPU: no NVML, no error
    report = (out / "report.md").read_text()
    final = json.loads((out / "final.json").read_text())
    assert json.loads((out / "run_meta.json").read_text())["outcome"] == final
    assert final["step"] == 5 and final["stopped_early"] is False and final["tokens_seen"] == train[-1]["tokens_seen"]
    assert "![training curves](training.png)" in report and (out / "training.png").is_file()
    assert f"| tokens seen | {train[-1]['tokens_seen']:,} |" in report
    assert f"| best validation loss | {min(val):,.4f} (step {best_step}) |" in report
    assert f"| final validation loss | {val[-1]:,.4f} |" in report
    # every row: its interval's tokens over its time in training steps; the report: all tokens over all that time
    tokens_per_step = train[0]["tokens_seen"]
    assert all(r["tokens_per_sec"] * r["interval_time_s"] == pytest.approx(r["interval_steps"] * tokens_per_step)
               for r in train) and sum(r["interval_steps"] for r in train) == final["step"]
    seconds = sum(r["interval_time_s"] for r in train)
    assert f"| {final['tokens_seen'] / seconds:,.1f} |" in report
    assert f"{100 * sum(r['mfu'] * r['interval_time_s'] for r in train) / seconds:,.2f} %" in report
    assert f"{max(r['peak_mem_gb'] for r in train):,.3f} GB" in report
    assert seconds <= final["wall_time_s"] and all(r["host_rss_gb"] > 0 for r in train)
    device_hours = final["wall_time_s"] / 3600
    assert final["wall_time_s"] > 0 and f"| device-hours | {device_hours:,.4f} |" in report
    assert f"| {device_hours * 2.5:,.2f} |" in report
    # differences from the recipe file: the test's overrides
    assert '| `train.max_steps` | 300 | 5 |' in report and '| `profile.first_step` | null | 2 |' in report
    assert "torch " + torch.__version__ in report
    (launch,) = json.loads((out / "run_meta.json").read_text())["launches"]
    assert launch["command"][0] == "train.py" and "profile.first_step=2" in launch["command"]
    assert launch["start_step"] == 0 and launch["world_size"] == 1 and f"`{' '.join(launch['command'])}`" in report


@pytest.mark.slow
def test_report_sets_the_plan_against_the_measurement(profiled_run):
    out, _ = profiled_run
    meta = json.loads((out / "run_meta.json").read_text())
    train = [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    cfg = load_config(out / "config.yaml")
    # The planner's CPU MFU (0.4) of the peak the run itself measured, at the run's FLOPs per token.
    tokens_per_sec = 0.4 * meta["peak_tflops_per_device"] * 1e12 / meta["flops_per_token"]
    step_time_s = cfg.train.global_batch_size * cfg.data.seq_len / tokens_per_sec
    shape = shape_from_config(cfg.model, int(load_meta(cfg.data.path)["vocab_size"])).memory_shape()  # = model_shape's
    peak_gb = estimate(shape, ZeroSetup(), 1, 1, "fp32", meta["accum_steps"], cfg.train.micro_batch_size,
                       cfg.data.seq_len, False).device_total / 1e9
    seconds = sum(r["interval_time_s"] for r in train)
    measured = {"tokens_per_sec": train[-1]["tokens_seen"] / seconds,
                "mfu": sum(r["mfu"] * r["interval_time_s"] for r in train) / seconds,
                "step_time_s": seconds / train[-1]["step"]}
    measured_peak = max(r["peak_mem_gb"] for r in train)
    report = (out / "report.md").read_text()
    assert "## Plan against measurement" in report
    assert (f"| throughput (tokens/s, all processes) | {tokens_per_sec:,.1f} | {measured['tokens_per_sec']:,.1f} | "
            f"{measured['tokens_per_sec'] / tokens_per_sec:,.2f} |") in report
    assert f"| MFU | 40.00 % | {100 * measured['mfu']:,.2f} % | {measured['mfu'] / 0.4:,.2f} |" in report
    assert (f"| step time (s) | {step_time_s:,.4f} | {measured['step_time_s']:,.4f} | "
            f"{measured['step_time_s'] / step_time_s:,.2f} |") in report
    assert (f"| peak memory per process | {peak_gb:,.3f} GB | {measured_peak:,.3f} GB | "
            f"{measured_peak / peak_gb:,.2f} |") in report
    assert "On a CPU the planner's figures are those of the accelerator it models" in report


# ---------------------------------------------------------------------------------------------- early stopping


def test_early_stopping_stops_keeps_best_and_exports_from_it(tmp_path, tiny_data):
    out = tmp_path / "run"
    # No evaluation can beat the first by 100: the second and third do not improve, so the run stops at step 3.
    proc = run_train(out, tiny_data, ["train.max_steps=20", "train.eval_every_steps=1", "checkpoint.every_steps=1",
                                      "checkpoint.keep_last=1", "train.early_stopping_patience=2",
                                      "train.early_stopping_min_delta=100", "checkpoint.export_at_end=true",
                                      "checkpoint.export_dtype=fp32"])
    final = json.loads((out / "final.json").read_text())
    assert final["stopped_early"] is True and final["step"] == 3 and final["evals_without_improvement"] == 2
    assert pointer(out, "latest") == "step_00000003"
    evals = [r for r in read_metrics(out / "metrics.jsonl") if "val_loss" in r]
    best = f"step_{min(evals, key=lambda r: r['val_loss'])['step']:08d}"
    assert pointer(out, "best") == best and best in checkpoint_names(out)  # kept apart from keep_last=1
    assert final["export_from"].endswith(best) and final["best_val_loss"] == min(r["val_loss"] for r in evals)
    assert json.loads((out / "run_meta.json").read_text())["outcome"]["export_from"] == final["export_from"]
    assert "Early stopping at step 3" in proc.stderr and f"from {final['export_from']}" in proc.stderr
    exported = {}
    for shard in (out / "export").glob("*.safetensors"):
        exported.update(load_file(shard))
    saved = load_file(out / "checkpoints" / best / "model.safetensors")
    assert exported.keys() == saved.keys() and all(torch.equal(exported[k], saved[k]) for k in saved)
    assert "stopped early" in (out / "report.md").read_text()


@pytest.mark.slow
def test_a_resume_keeps_the_patience_counter(tmp_path, tiny_data):
    out = tmp_path / "run"
    common = ["train.eval_every_steps=1", "checkpoint.every_steps=1", "train.early_stopping_patience=3",
              "train.early_stopping_min_delta=100"]
    run_train(out, tiny_data, ["train.max_steps=2", *common])
    saved = json.loads((out / "checkpoints" / "step_00000002" / "train_state.json").read_text())
    assert saved["extras"]["early_stopping"]["evals_without_improvement"] == 1
    run_train(out, tiny_data, ["train.max_steps=20", *common])
    # 1 kept + steps 3 and 4 = patience 3: stop at 4 (a counter reset on resume would stop at 5)
    assert json.loads((out / "final.json").read_text())["step"] == 4


# ---------------------------------------------------------------------------------------------- determinism


@pytest.mark.slow
def test_deterministic_runs_are_bitwise_equal(tmp_path, tiny_data):
    outs = [tmp_path / "a", tmp_path / "b"]
    procs = [run_train(out, tiny_data, ["train.max_steps=4", "train.deterministic=true"]) for out in outs]
    assert "Deterministic mode" in procs[0].stderr
    a, b = ([(r["loss"], r["grad_norm"]) for r in read_metrics(out / "metrics.jsonl") if "loss" in r] for out in outs)
    assert len(a) == 4 and a == b  # exact equality of floats
    wa, wb = (load_file(out / "checkpoints" / "step_00000004" / "model.safetensors") for out in outs)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


# ---------------------------------------------------------------------------------------------- out of memory


def test_oom_in_a_step_ends_with_a_diagnosis_and_no_partial_checkpoint(tmp_path, tiny_data, monkeypatch):
    out = tmp_path / "run"
    monkeypatch.setenv(FAULT_ENV, "3")
    proc = run_train(out, tiny_data, ["train.max_steps=6", "checkpoint.every_steps=1"], check=False)
    assert proc.returncode == EXIT_USER_ERROR, proc.stderr[-3000:]
    err = proc.stderr
    assert "Traceback" not in err
    assert "Out of host memory (RAM) in optimizer step 3" in err
    assert "train.micro_batch_size=4 sequences of data.seq_len=32 tokens" in err
    assert re.search(r"Estimated need per rank \(lmrecipe/planning/memory.py\): [\d.]+ \w+ .*; host RAM: [\d.]+ GiB", err)
    ways = ["train.micro_batch_size=2: train.global_batch_size stays 8, accumulation becomes 4",
            "train.gradient_checkpointing=true", "distributed.deepspeed_config=zero3 ",
            "distributed.deepspeed_config=zero3_offload"]
    positions = [err.find(w) for w in ways]
    assert all(p >= 0 for p in positions) and positions == sorted(positions), positions
    assert checkpoint_names(out) == ["step_00000001", "step_00000002"] and pointer(out, "latest") == "step_00000002"
    assert not (out / "final.json").exists()
