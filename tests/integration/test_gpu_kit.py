"""bench/gpu/run.py, the GPU kit, on a CPU: its dry run builds and runs every stage (tiny model, 2 steps), so the kit
cannot rot between GPU runs; bad arguments and a missing GPU exit 2 with the fix."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
from helpers import ROOT, run_script

KIT = ROOT / "bench" / "gpu"


def _kit_module(name: str):
    if str(KIT) not in sys.path:
        sys.path.insert(0, str(KIT))  # as Python does for the kit's scripts: their modules sit beside them
    spec = importlib.util.spec_from_file_location(f"gpu_kit_{name}", KIT / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory, tiny_data):
    out = tmp_path_factory.mktemp("gpu_kit")
    run_script(["bench/gpu/run.py", "--dry-run", "--stages", "all", "--out", str(out / "out"), "--work",
                str(out / "work"), "--data", str(tiny_data)])
    return json.loads((out / "out" / "gpu_kit.json").read_text())


@pytest.mark.slow
def test_dry_run_measures_every_stage_and_writes_a_row_each(dry_run):
    record = dry_run
    stages = _kit_module("stages")
    assert [row["stage"] for row in record["stages"]] == [stage.name for stage in stages.STAGES]
    assert record["mode"].startswith("dry run") and record["steps"] == 2
    assert record["versions"]["torch"] and "deepspeed" in record["versions"]
    for row in record["stages"]:
        assert {"stage", "what", "target", "status", "sides"} <= set(row), row["stage"]
        assert row["status"].startswith("dry run"), (row["stage"], row["status"])
        for label, side in row["sides"].items():
            if label != "levers":
                assert side["steps"] == 2 and side["tokens_per_sec"] > 0, (row["stage"], label)
                assert side["prediction"]["tokens_per_sec"] > 0 and side["measured_over_predicted"]["tokens_per_sec"] > 0


@pytest.mark.slow
def test_dry_run_figures_come_from_the_configurations_they_name(dry_run):
    sides = next(row for row in dry_run["stages"] if row["stage"] == "levers")["sides"]
    assert sides["no DeepSpeed"]["zero"] == "no DeepSpeed" and sides["levers"]["zero"] == "DeepSpeed ZeRO-2"
    assert sides["no DeepSpeed"]["overrides"] == ["distributed.deepspeed_config=null"]


@pytest.mark.slow
def test_the_levers_switch_in_place_and_say_what_they_could_not_measure(dry_run):
    levers = next(row for row in dry_run["stages"] if row["stage"] == "levers")["sides"]["levers"]
    windows = levers["windows"]
    assert list(windows) == ["baseline", "full logits", "fused AdamW", "accumulation 16"]
    assert windows["baseline"]["levers"]["loss_chunk_tokens"] == 64 and windows["full logits"]["levers"]["loss_chunk_tokens"] == 0
    assert windows["baseline"]["levers"]["optimizer"] == "foreach AdamW"
    assert windows["fused AdamW"]["levers"]["optimizer"] == "fused AdamW"
    assert windows["accumulation 16"]["tokens_per_step"] == 8 * windows["baseline"]["tokens_per_step"]
    for name, w in windows.items():  # weights held: every lever computes the baseline's loss (fp32 on a CPU)
        assert w["tokens_per_sec"] > 0 and abs(w["held_loss_diff"]) < 1e-5 and w["held_loss_agrees"], name
    assert levers["skipped"]["varlen"] == levers["skipped"]["flex_attention"] == "needs a CUDA GPU"
    assert "model.kernels=liger" in levers["skipped"]["liger"] and "needs a CUDA GPU" in levers["skipped"]["compile"]
    assert levers["baseline_vs_recorded"]["recorded_mfu"] == pytest.approx(0.285, abs=1e-3)
    assert levers["preamble"]["gemm_bf16_tflops"] > 0 and "cum_seq_q" in levers["preamble"]["schema_flash_attention_forward"]
    assert levers["preamble"]["init_std"]["norm"] == 1.0 and abs(levers["preamble"]["init_std"]["mlp"] - 0.02) < 2e-3
    # The first build is dropped whole before the second: weak references to its bare model, its DeepSpeed engine
    # and ZeRO-2 optimizer are dead (DeepSpeed's gradient hooks held them until engine.destroy()); nothing is noted.
    assert levers["first_run_alive"] == [] and levers["notes"] == []
    assert levers["second_build_s"] > 0 and levers["zero"] == "DeepSpeed ZeRO-2"
    assert list(levers["profile"]) == ["baseline", "best"]  # the fused AdamW window ran: its profile, not the first's
    for when in ("baseline", "best"):
        ms = levers["profile"][when]["ms"]
        assert set(ms) == {"matmuls", "attention", "elementwise", "loss", "optimizer", "copies"}
        assert ms["matmuls"] > 0 and ms["attention"] > 0, ms


def test_a_side_stopped_after_its_timed_steps_keeps_them():
    run = _kit_module("run")
    stages = _kit_module("stages")
    levers = stages.BY_NAME["levers"]
    timed = {"label": "no DeepSpeed", "tokens_per_sec": 1.0, "partial": True,
             "stopped": "worker stopped after 30 s (the call's budget) after its timed steps: ..."}
    row = run.stage_row(levers, {side.key: timed for side in levers.sides}, dry_run=False)
    assert row["status"].startswith("failed: summary (KeyError: 'windows')")  # the sweep's side stopped before a window
    assert "worker stopped after 30 s" in row["status"]
    # a sweep cut short keeps the windows it wrote
    windows = {"baseline": {"tokens_per_sec": 34000.0, "mfu": 0.3, "data_share": 0.004}, "full logits": {"error": "OOM"}}
    cut = {**timed, "label": "levers", "windows": windows, "skipped": {}}
    no_ds = {"label": "no DeepSpeed", "tokens_per_sec": 17000.0}
    row = run.stage_row(levers, {levers.sides[0].key: no_ds, levers.sides[1].key: cut}, dry_run=False)
    assert row["status"] == "measured"
    assert row["figure"].startswith("baseline 34,000 tokens/s, MFU 30.0%, data wait 0.4% of the step; best (baseline)")
    assert row["figure"].endswith("no DeepSpeed 0.500x the baseline")


def test_an_unknown_stage_exits_2_naming_the_choices(tmp_path):
    proc = run_script(["bench/gpu/run.py", "--dry-run", "--stages", "levers,mfu", "--out", str(tmp_path)],
                      check=False)
    assert proc.returncode == 2
    assert "unknown stage 'mfu'" in proc.stderr and "choose from levers, or 'default' or 'all'" in proc.stderr
    assert not (tmp_path / "gpu_kit.json").exists()


def test_without_a_gpu_only_the_dry_run_runs(tmp_path):
    proc = run_script(["bench/gpu/run.py", "--out", str(tmp_path)], check=False, env_extra={"CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 2 and "--dry-run" in proc.stderr
