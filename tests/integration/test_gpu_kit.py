"""bench/gpu/run.py, the GPU kit, on a CPU: its dry run builds and runs every stage (tiny model, 2 steps), so the kit
cannot rot between lent GPU machines; bad arguments and a missing GPU exit 2 with the fix; a stale pack is refused."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

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
        if row["stage"] in ("flash", "flash3") and row["status"].startswith("skipped: "):
            assert "is not installed" in row["status"]
            continue  # flash-attn is a GPU package
        assert row["status"].startswith("dry run"), (row["stage"], row["status"])
        for label, side in row["sides"].items():
            assert side["steps"] == 2 and side["tokens_per_sec"] > 0, (row["stage"], label)
            assert side["prediction"]["tokens_per_sec"] > 0 and side["measured_over_predicted"]["tokens_per_sec"] > 0


@pytest.mark.slow
def test_dry_run_figures_come_from_the_configurations_they_name(dry_run):
    record = dry_run
    rows = {row["stage"]: row for row in record["stages"]}
    zero = rows["zero_stages"]["sides"]
    assert [zero[label]["zero"] for label in ("ZeRO-1", "ZeRO-2", "ZeRO-3")] == \
        ["DeepSpeed ZeRO-1", "DeepSpeed ZeRO-2", "DeepSpeed ZeRO-3"]
    assert rows["fp8"]["sides"]["fp8 ZeRO-2"]["precision"] == "fp8"
    assert rows["document_masking"]["sides"]["masking off"]["document_masking"] is False
    assert rows["chunked_loss"]["sides"]["full logits"]["micro_batch_size"] == 4
    # The sync-free step of the CPU test holds in the kit's count too; the bf16 ZeRO-2 run is measured once and
    # shared by the stages that name it.
    assert rows["host_syncs"]["sides"]["no DeepSpeed"]["host_syncs"]["per_step"] == 0
    assert rows["mfu_zero2"]["sides"]["bf16 ZeRO-2"] == rows["fp8"]["sides"]["bf16 ZeRO-2"]
    stall = rows["checkpoint_stall"]["sides"]["bf16 ZeRO-2 checkpoints"]["checkpoint_stall"]
    assert stall["sync"]["blocked_s"] > 0 and stall["background"]["blocked_s"] > 0 and stall["checkpoint_gb"] > 0


@pytest.mark.slow
def test_the_profile_stage_ranks_operators_not_the_trainer_s_own_ranges(dry_run):
    record = dry_run
    profile = next(row for row in record["stages"] if row["stage"] == "profile")
    for label, side in profile["sides"].items():
        p = side["profile"]
        assert p["wall_s"] > 0 and len(p["top"]) == 15, label
        names = [k["name"] for k in p["top"]]
        assert any(name.startswith("aten::") for name in names), names
        assert not any(name.startswith("lmrecipe/") for name in names), names  # record_function ranges left out
        assert all(a["ms"] >= b["ms"] for a, b in zip(p["top"], p["top"][1:]))
    assert profile["sides"]["bf16 ZeRO-2"] == next(
        row for row in record["stages"] if row["stage"] == "mfu_zero2")["sides"]["bf16 ZeRO-2"]


def test_a_side_stopped_after_its_timed_steps_keeps_them():
    run = _kit_module("run")
    stages = _kit_module("stages")
    stall = stages.BY_NAME["checkpoint_stall"]
    timed = {"label": "bf16 ZeRO-2 checkpoints", "tokens_per_sec": 1.0, "partial": True,
             "stopped": "worker stopped after 30 s (the call's budget) after its timed steps: ..."}
    row = run.stage_row(stall, {" ".join(stall.sides[0].overrides): timed}, dry_run=False)
    assert row["status"].startswith("failed: summary (KeyError: 'checkpoint_stall')")
    assert "worker stopped after 30 s" in row["status"]
    mfu = stages.BY_NAME["mfu_zero2"]
    timed = {**timed, "label": "bf16 ZeRO-2", "mfu": 0.3, "tokens_per_sec": 34000.0, "step_time_s": 0.96}
    row = run.stage_row(mfu, {" ".join(mfu.sides[0].overrides): timed}, dry_run=False)
    assert row["status"] == "measured" and row["figure"].startswith("34,000 tokens/s, MFU 30.0%")


def test_an_unknown_stage_exits_2_naming_the_choices(tmp_path):
    proc = run_script(["bench/gpu/run.py", "--dry-run", "--stages", "mfu_zero2,mfu", "--out", str(tmp_path)],
                      check=False)
    assert proc.returncode == 2
    assert "unknown stage 'mfu'" in proc.stderr and "mfu_zero2, host_syncs" in proc.stderr
    assert not (tmp_path / "gpu_kit.json").exists()


def test_without_a_gpu_only_the_dry_run_runs(tmp_path):
    proc = run_script(["bench/gpu/run.py", "--out", str(tmp_path)], check=False, env_extra={"CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 2 and "--dry-run" in proc.stderr


def test_the_pack_script_passes_shellcheck():
    shellcheck = Path(sys.executable).with_name("shellcheck")
    proc = subprocess.run([str(shellcheck), "--shell=bash", str(KIT / "pack.sh")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


def test_a_pack_for_other_pins_is_refused(tmp_path):
    install = _kit_module("install")
    (tmp_path / "transformers-5.17.0-py3-none-any.whl").write_bytes(b"")
    (tmp_path / "files.txt").write_text("transformers-5.17.0-py3-none-any.whl\n")
    (tmp_path / "requirements.txt").write_text("transformers==5.17.0\n")
    with pytest.raises(ValueError, match="pack.sh"):
        install.check_packed(tmp_path)
    (tmp_path / "requirements.txt").write_text(f"transformers=={install.project_pins()['transformers']}\n")
    assert install.check_packed(tmp_path)["files"] == ["transformers-5.17.0-py3-none-any.whl"]
    (tmp_path / "files.txt").write_text("deepspeed-0.19.8.tar.gz\n")
    with pytest.raises(ValueError, match="lacks deepspeed"):
        install.check_packed(tmp_path)
