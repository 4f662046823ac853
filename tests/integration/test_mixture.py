"""Weighted data mixtures: config records, the order as a pure function of the global sample index, realised
proportions, per-source metrics end to end, exact resume, and bad input stopping before anything is written."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from helpers import TINY_OVERRIDES, run_script, sources_arg

from lmrecipe.observe.metrics_log import read_metrics

LOSS_TOL = 1e-5


def mix_args(out: Path, sources: str, *overrides: str) -> list[str]:
    return ["train.py", "recipes/tiny.yaml", f"out_dir={out}", *TINY_OVERRIDES, sources, *overrides]


STEPS = ["train.max_steps=6", "train.eval_every_steps=3", "checkpoint.every_steps=3"]


@pytest.fixture(scope="module")
def mixture_run(tmp_path_factory, two_sources) -> Path:
    """6 steps of a 0.7 / 0.3 mixture on one process."""
    code, prose = two_sources
    full = tmp_path_factory.mktemp("mixture") / "full"
    run_script(mix_args(full, sources_arg((code, 0.7, None), (prose, 0.3, None)), *STEPS, "logging.plots=true"))
    return full


def test_two_source_run_reports_per_source_metrics(mixture_run):
    full = mixture_run
    rows = read_metrics(full / "metrics.jsonl")
    train_rows = [r for r in rows if "loss" in r]
    val_rows = [r for r in rows if "val_loss" in r]
    assert [r["step"] for r in train_rows] == [1, 2, 3, 4, 5, 6] and [r["step"] for r in val_rows] == [3, 6]
    for r in train_rows:  # every sample is counted once, by its source; 8 x 32 tokens per step
        assert r["tokens_seen/code"] + r["tokens_seen/prose"] == r["tokens_seen"] == r["step"] * 8 * 32
    assert train_rows[-1]["tokens_seen/code"] == round(6 * 8 * 0.7) * 32  # 48 samples, 0.7 of them within one
    for r in val_rows:
        assert r["val_loss/code"] > 0 and r["val_loss/prose"] > 0
        assert r["val_loss"] == pytest.approx(0.7 * r["val_loss/code"] + 0.3 * r["val_loss/prose"], rel=1e-12)
    assert (full / "training.png").stat().st_size > 10_000
    meta = json.loads((full / "run_meta.json").read_text())
    assert [(s["name"], s["weight"]) for s in meta["data_mixture"]] == [("code", 0.7), ("prose", 0.3)]
    saved = json.loads((full / "checkpoints/step_00000003/train_state.json").read_text())
    assert saved["data"]["next_sample"] == 24 and [s["name"] for s in saved["data"]["mixture"]] == ["code", "prose"]


@pytest.mark.slow
def test_two_source_run_resumes_exactly_and_refuses_other_weights(tmp_path, two_sources, mixture_run):
    code, prose = two_sources
    mix = sources_arg((code, 0.7, None), (prose, 0.3, None))
    steps = STEPS
    full = mixture_run
    rows = read_metrics(full / "metrics.jsonl")
    # Resume from the step-3 checkpoint in a new run folder: the same losses and per-source figures.
    resumed = tmp_path / "resumed"
    proc = run_script(mix_args(resumed, mix, *steps, f"checkpoint.resume={full}/checkpoints/step_00000003"))
    assert "Resumed from" in proc.stderr
    again = {(r["step"], "val_loss" in r): r for r in read_metrics(resumed / "metrics.jsonl")}
    assert sorted(again) == [(4, False), (5, False), (6, False), (6, True)]
    worst = 0.0
    for r in rows:
        if r["step"] > 3:
            twin = again[r["step"], "val_loss" in r]
            for key in ("loss", "val_loss", "val_loss/code", "val_loss/prose"):
                if key in r:
                    worst = max(worst, abs(twin[key] - r[key]))
                    assert abs(twin[key] - r[key]) <= LOSS_TOL, (r["step"], key, twin[key], r[key])
            assert all(twin[k] == r[k] for k in r if k.startswith("tokens_seen"))
    print(f"2-source mixture, 1 process: max |loss difference| after resume = {worst:.3g}")

    # Other weights on resume would remap every global sample index: refused, naming the change.
    changed = tmp_path / "changed"
    proc = run_script(mix_args(changed, sources_arg((code, 0.5, None), (prose, 0.5, None)), *steps,
                               f"checkpoint.resume={full}/checkpoints/step_00000003"), check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "data sources: mixture code 0.7, prose 0.3 -> mixture code 0.5, prose 0.5" in proc.stderr


@pytest.mark.slow
def test_a_mixture_on_two_processes_trains_like_one(tmp_path, two_sources, mixture_run):
    """The same global samples per step, split over 2 ranks: the same losses, per-source tokens and validation."""
    code, prose = two_sources
    two = tmp_path / "two"
    run_script(mix_args(two, sources_arg((code, 0.7, None), (prose, 0.3, None)), *STEPS), nproc=2)
    one_rows = {(r["step"], "val_loss" in r): r for r in read_metrics(mixture_run / "metrics.jsonl")}
    two_rows = {(r["step"], "val_loss" in r): r for r in read_metrics(two / "metrics.jsonl")}
    assert sorted(two_rows) == sorted(one_rows)
    for key, row in one_rows.items():
        for name in ("loss", "val_loss", "val_loss/code", "val_loss/prose"):
            if name in row:
                assert abs(two_rows[key][name] - row[name]) <= LOSS_TOL, (key, name, two_rows[key][name], row[name])
        assert all(two_rows[key][k] == row[k] for k in row if k.startswith("tokens_seen"))


def test_eval_reports_each_source_and_the_weighted_loss_as_training_did(tmp_path, two_sources, mixture_run):
    """eval.py on the run's last checkpoint, both folders and the run's weights, over the windows training evaluates
    (data.val_windows=16 = 4 batches of 4): the per-source and weighted losses of the run's last evaluation."""
    code, prose = two_sources
    checkpoint = mixture_run / "checkpoints" / "step_00000006"
    out = tmp_path / "eval.json"
    run_script(["eval.py", str(checkpoint), "--data", str(code), str(prose), "--source-weights", "0.7", "0.3",
                "--batch-size", "4", "--max-batches", "4", "--output", str(out)])
    result = json.loads(out.read_text())
    (last,) = [r for r in read_metrics(mixture_run / "metrics.jsonl") if r.get("step") == 6 and "val_loss" in r]
    assert sorted(result["sources"]) == ["code", "prose"]
    for name in ("code", "prose"):
        assert abs(result["sources"][name]["loss"] - last[f"val_loss/{name}"]) <= LOSS_TOL, (name, result, last)
        assert result["sources"][name]["tokens"] == 16 * 32
    assert abs(result["loss"] - last["val_loss"]) <= LOSS_TOL
    assert result["sources"]["code"]["weight"] == pytest.approx(0.7) and result["tokens"] == 2 * 16 * 32
    # A weight of 0 reports the folder and leaves it out of the mean (what eval.py calls, in this process).
    from lmrecipe.evaluation.evaluate import evaluate_path

    result, _ = evaluate_path(checkpoint, [code, prose], max_batches=4, batch_size=4, source_weights=[1, 0])
    assert result["loss"] == pytest.approx(result["sources"]["code"]["loss"], rel=1e-12)
    assert abs(result["sources"]["prose"]["loss"] - last["val_loss/prose"]) <= LOSS_TOL
    # One weight per folder, or exit 2 with the fix.
    proc = run_script(["eval.py", str(checkpoint), "--data", str(code), str(prose), "--source-weights", "1"],
                      check=False)
    assert proc.returncode == 2 and "one weight per folder" in proc.stderr and "Traceback" not in proc.stderr


def bad_inputs(tmp_path: Path, two_sources: list[Path]) -> dict[str, tuple[str, str]]:
    code, prose = two_sources
    (tmp_path / "empty").mkdir()
    empty_train = tmp_path / "empty_train"  # same tokenizer, no training tokens
    shutil.copytree(prose, empty_train)
    (empty_train / "train.bin").write_bytes(b"")
    np.zeros(1, dtype="<u8").tofile(empty_train / "train.idx")
    meta = json.loads((empty_train / "meta.json").read_text())
    meta["splits"]["train"].update(n_tokens=0, n_documents=0)
    (empty_train / "meta.json").write_text(json.dumps(meta))
    other = tmp_path / "other_tok"  # the same vocabulary size and EOS, another tokenizer.json
    shutil.copytree(prose, other)
    (other / "tokenizer.json").write_text((other / "tokenizer.json").read_text() + "\n")
    return {
        "negative": (sources_arg((code, 1, None), (prose, -1, None)), "data.sources[1].weight=-1.0"),
        "zero_sum": (sources_arg((code, 0, None), (prose, 0, None)), "sum to zero"),
        "duplicate": (sources_arg((code, 1, "x"), (prose, 1, "x")), "both named 'x'"),
        "missing": (sources_arg((code, 1, None), (tmp_path / "nope", 1, None)), "data.sources[1] (nope"),
        "empty_folder": (sources_arg((code, 1, None), (tmp_path / "empty", 1, None)), "is empty"),
        "empty_split": (sources_arg((code, 1, None), (empty_train, 1, None)), "The train split of"),
        "tokenizer": (sources_arg((code, 1, None), (other, 1, None)), "does not share the tokenizer"),
    }


@pytest.mark.parametrize("case", ["negative", "zero_sum", "duplicate", "tokenizer"])
def test_bad_input_exits_2_and_writes_nothing(tmp_path, two_sources, case):
    """Through train.py: the config's checks, and one of the data folders' (the others' below, in this process)."""
    arg, expected = bad_inputs(tmp_path, two_sources)[case]
    out = tmp_path / "run"
    proc = run_script(mix_args(out, arg, "train.max_steps=2"), check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert expected in proc.stderr and "Traceback" not in proc.stderr
    assert not out.exists()


@pytest.mark.parametrize("case", ["missing", "empty_folder", "empty_split"])
def test_a_bad_data_folder_is_refused_before_anything_is_written(tmp_path, two_sources, case):
    """The data folders' checks raise the error train.py turns into exit 2 (the case above shows it does)."""
    from lmrecipe.config import load_config
    from lmrecipe.errors import UserError
    from lmrecipe.train.trainer import train

    arg, expected = bad_inputs(tmp_path, two_sources)[case]
    out = tmp_path / "run"
    with pytest.raises(UserError, match=re.escape(expected)) as err:
        train(load_config("recipes/tiny.yaml", [f"out_dir={out}", *TINY_OVERRIDES, arg, "train.max_steps=2"]))
    assert err.value.exit_code == 2
    assert not out.exists()
