"""The run's records from synthetic rows: throughput over the time in training steps, the plan table, the CPU note,
the sessions of run_meta.json, the CPU peak reference, training.png and the capped validation set."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from helpers import ROOT

from lmrecipe.config import LoggingConfig, load_config
from lmrecipe.data.batches import BatchLayout
from lmrecipe.observe import device, plots
from lmrecipe.observe.console import Reporter
from lmrecipe.observe.metrics_log import read_metrics, throughput
from lmrecipe.observe.run_meta import (RUN_META_FILE, launch_record, read_run_meta, record_event, run_events,
                                       write_run_meta)
from lmrecipe.observe.run_report import build_report, summarize_metrics
from lmrecipe.parallel.topology import Topology
from lmrecipe.train.callbacks.reporting import log_start

TOKENS_PER_STEP = 1000
# (steps, seconds in training steps) of four intervals whose rates differ 100-fold
INTERVALS = [(1, 10.0), (9, 0.9), (10, 5.0), (10, 2.0)]


def rows_of(intervals, tokens_per_step: int = TOKENS_PER_STEP, peak_flops: float = 0.09e12) -> list[dict]:
    rows, step = [], 0
    for steps, seconds in intervals:
        step += steps
        rate = steps * tokens_per_step / seconds
        rows.append({"step": step, "tokens_seen": step * tokens_per_step, "loss": 5.0, "tokens_per_sec": rate,
                     "mfu": rate * 6e3 / peak_flops, "step_time_s": seconds / steps, "interval_steps": steps,
                     "interval_time_s": seconds, "peak_mem_gb": 0.5})
    return rows


def test_throughput_is_all_tokens_over_all_time_not_a_mean_of_rates():
    rows = rows_of(INTERVALS) + [{"step": 30, "tokens_seen": 30_000, "val_loss": 4.0, "val_ppl": 54.6}]
    figures = summarize_metrics(rows)
    tokens, seconds = 30 * TOKENS_PER_STEP, sum(s for _, s in INTERVALS)
    assert figures["tokens_per_sec"] == pytest.approx(tokens / seconds, rel=1e-12)  # 1,678.3, the mean of rates 4,075
    assert figures["step_time_s"] == pytest.approx(seconds / 30, rel=1e-12)
    assert figures["tokens_per_sec"] * figures["step_time_s"] == pytest.approx(TOKENS_PER_STEP, rel=1e-12)
    assert figures["mfu"] == pytest.approx(tokens / seconds * 6e3 / 0.09e12, rel=1e-12)
    assert figures["tokens_per_sec_after_first"] == pytest.approx(29 * TOKENS_PER_STEP / (seconds - 10.0), rel=1e-12)


def test_rows_without_interval_fields_count_their_steps_at_their_step_time():
    rows = [{k: v for k, v in r.items() if not k.startswith("interval_")} for r in rows_of(INTERVALS)]
    assert throughput(rows)["tokens_per_sec"] == pytest.approx(30 * TOKENS_PER_STEP / 17.9, rel=1e-12)


def _ratios(report: str) -> dict[str, float]:
    table = report.split("## Plan against measurement", 1)[1].split("\n## ", 1)[0]
    return {m[1]: float(m[2].replace(",", "")) for m in re.finditer(r"^\| ([^|]+?) \| [^|]+ \| [^|]+ \| ([\d.,]+) \|$",
                                                                    table, re.M)}


@pytest.mark.parametrize("gpu", [None, "NVIDIA H100 80GB HBM3"])
def test_plan_table_agrees_with_itself_and_explains_a_cpu(tmp_path, gpu):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows_of(INTERVALS)))
    hardware = {"platform": "Linux", "cpu_count": 2, "torch_threads": 2, **({"gpu": gpu} if gpu else {})}
    meta = {"world_size": 1, "hardware": hardware, "precision": "fp32", "peak_tflops_per_device": 0.09,
            "peak_tflops_source": "matmul probe", "flops_per_token": 6e3, "n_params": 1000, "config": {},
            "launches": [{"start_step": 0, "resumed_from": None, "world_size": 1, "command": ["train.py", "r.yaml"],
                          "started_at": "2026-01-01T00:00:00+00:00", "host_rss_gb_before_training": 0.41}]}
    predicted_rate = 0.4 * 0.09e12 / 6e3  # the planner's: 40% of the peak at 6e3 FLOPs per token
    prediction = {"tokens_per_sec": predicted_rate, "mfu": 0.4, "mfu_source": "a benchmark",
                  "step_time_s": TOKENS_PER_STEP / predicted_rate, "peak_mem_gb": 0.1, "model_states_gb": 0.05,
                  "model_states_measured_gb": None}
    report = build_report(tmp_path, meta, {"step": 30, "tokens_seen": 30_000, "wall_time_s": 20.0}, None, prediction)
    ratios = _ratios(report)
    # measured / predicted of one figure is predicted / measured of the other (to the table's two decimals)
    assert ratios["throughput (tokens/s, all processes)"] == pytest.approx(1 / ratios["step time (s)"], abs=0.006)
    assert ratios["MFU"] == ratios["throughput (tokens/s, all processes)"]
    assert f"| {30_000 / 17.9:,.1f} |" in report and "| 17.9 s of 20.0 s |" in report
    assert "| `train.py r.yaml` |" in report  # the sessions' table
    cpu_note = "On a CPU the planner's figures are those of the accelerator it models"
    assert (cpu_note in report) is (gpu is None)
    if gpu is None:
        assert "0.410 GB of it was already resident before the first step" in report


def _reporter(tmp_path: Path, run_meta: dict | None = None, launch: dict | None = None) -> Reporter:
    accelerator = SimpleNamespace(device=torch.device("cpu"), num_processes=1, is_main_process=True,
                                  reduce=lambda tensor, reduction: tensor)
    section = LoggingConfig(log_every_steps=3, progress_bar=False, trackers=[], peak_tflops=1.0)
    return Reporter(section, accelerator, tmp_path, precision="fp32", max_steps=6, start_step=0,
                    tokens_per_step=TOKENS_PER_STEP, flops_per_token=6e3, run_config={},
                    run_meta={"n_params": 2_500_000, **(run_meta or {})}, launch=launch)


def test_every_row_is_its_intervals_tokens_over_its_time_in_steps_and_the_plot_has_a_title(tmp_path, monkeypatch):
    reporter = _reporter(tmp_path, launch=launch_record(["train.py", "recipes/tiny.yaml"], 1, 0, None))
    state = SimpleNamespace(step=0, tokens_seen=0, skipped_steps=0)
    step_times = [4.0, 0.5, 0.5, 0.25, 0.25, 0.25]  # step 1 (start-up) logged alone, then steps 2-3 and 4-6
    for step_time in step_times:
        state.step += 1
        state.tokens_seen += TOKENS_PER_STEP
        reporter.step_done(state, torch.tensor(3.0), 1e-3, 1.0, step_time, 0.01)
        if state.step == 2:
            reporter.eval_done(state, 3.5)  # an evaluation inside an interval takes no time from it
    saved = {}
    monkeypatch.setattr(plots, "_save", lambda fig, path: saved.update(fig=fig))
    reporter.close(plot=True)
    rows = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "loss" in r]
    assert [(r["step"], r["interval_steps"], r["interval_time_s"]) for r in rows] == [(1, 1, 4.0), (3, 2, 1.0), (6, 3, 0.75)]
    for r in rows:
        assert r["tokens_per_sec"] == pytest.approx(r["interval_steps"] * TOKENS_PER_STEP / r["interval_time_s"])
        assert r["host_rss_gb"] > 0
    assert throughput(rows)["tokens_per_sec"] == pytest.approx(6 * TOKENS_PER_STEP / sum(step_times))
    fig = saved["fig"]
    assert fig._suptitle.get_text() == f"{tmp_path.name}: 2.50M parameters, 6,000 tokens trained"
    assert any(child.get_xlabel() == "tokens" for ax in fig.axes for child in ax.child_axes)  # the token axis
    assert any(ax.get_ylabel() == "memory (GB)" and ax.lines for ax in fig.axes)
    launches = read_run_meta(tmp_path)["launches"]
    assert launches[0]["command"] == ["train.py", "recipes/tiny.yaml"] and launches[0]["host_rss_gb_before_training"] > 0


def test_launches_keep_the_first_start_and_events_mark_the_kept_history(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    write_run_meta(tmp_path, {"a": 1}, launch_record(["train.py", "x.yaml"], 2, 0, None))
    record_event(tmp_path, {"kind": "rollback", "step": 20})
    record_event(tmp_path, {"kind": "stop", "step": 40, "preempted": True, "exit_code": 143, "message": "SIGTERM"})
    write_run_meta(tmp_path, {"a": 2}, launch_record(["train.py", "x.yaml", "train.max_steps=90"], 2, 40, "ckpt/40"))
    record_event(tmp_path, {"kind": "rollback", "step": 60})
    record_event(tmp_path, {"kind": "stop", "step": 70, "preempted": True, "exit_code": 143, "message": "SIGTERM"})
    write_run_meta(tmp_path, {"a": 3}, launch_record(["train.py", "x.yaml"], 2, 50, "ckpt/50"))  # an older checkpoint
    meta = json.loads((tmp_path / RUN_META_FILE).read_text())
    assert meta["a"] == 3 and [launch["start_step"] for launch in meta["launches"]] == [0, 40, 50]
    assert meta["launches"][0]["command"] == ["train.py", "x.yaml"]
    assert meta["launches"][0]["launcher_env"]["WORLD_SIZE"] == "2" and meta["launches"][0]["world_size"] == 2
    # the second session's rollback at 60 and stop at 70 lie after step 50, where the third resumed: dropped history
    assert [(e["kind"], e["step"]) for e in run_events(meta)] == [
        ("rollback", 20), ("preemption", 40), ("resume", 40), ("resume", 50)]
    write_run_meta(tmp_path, {"a": 4}, launch_record(["train.py", "y.yaml"], 1, 0, None))  # a fresh start
    assert [launch["command"] for launch in read_run_meta(tmp_path)["launches"]] == [["train.py", "y.yaml"]]


def test_cpu_peak_is_the_highest_of_the_cached_probes(tmp_path, monkeypatch):
    path = tmp_path / "peak.json"
    got = [device.remembered_peak(path, "cpu", probe, keep=3)[0] for probe in (0.2, 0.03, 0.1, 0.09, 0.11)]
    assert got == [0.2, 0.2, 0.2, 0.1, 0.11]  # the 0.2 of a quiet moment holds for three probes
    assert json.loads(path.read_text()) == {"cpu": [0.1, 0.09, 0.11]}
    path.write_text("not json")
    assert device.remembered_peak(path, "cpu", 0.05) == (0.05, 1)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(device, "probe_cpu_matmul_tflops", lambda precision: 0.07)
    device.cpu_matmul_tflops.cache_clear()
    try:
        assert device.cpu_matmul_tflops("fp32") == 0.07
        cached = json.loads((tmp_path / "cache" / "lmrecipe" / "peak_tflops.json").read_text())
        assert cached == {device.machine_key("fp32"): [0.07]} and f"{torch.get_num_threads()} threads" in next(iter(cached))
    finally:
        device.cpu_matmul_tflops.cache_clear()


@pytest.mark.parametrize("main", [True, False])
def test_the_threads_line_is_the_main_processes_alone(main, caplog):
    cfg = load_config(ROOT / "recipes" / "tiny.yaml", ["train.max_steps=10"])
    run = SimpleNamespace(cfg=cfg, model=torch.nn.Linear(2, 2), n_params=10**6, n_active_params=None,
                          runtime=SimpleNamespace(topology=Topology(2), batch=BatchLayout(16, 8, 2, 0), precision="fp32"),
                          accelerator=SimpleNamespace(is_main_process=main, device=torch.device("cpu")),
                          data=SimpleNamespace(val_sets={}), lr_at=lambda step: 1e-4)
    with caplog.at_level(logging.INFO):
        log_start(run, {"implementation": "sdpa", "kernel": "sdpa, causal", "sdpa_backend": "MATH"}, "none")
    # on a CPU, once, what to set when other work shares the cores
    threads = [r for r in caplog.records if "set OMP_NUM_THREADS to the cores free for this run" in r.message]
    assert len(threads) == (1 if main else 0)
    assert not main or f"2 process(es) x {torch.get_num_threads()} torch threads" in threads[0].message
