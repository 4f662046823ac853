"""Ulysses sequence parallelism on 2 processes against 1 process without it: losses, gradient norms, validation,
resume onto another layout, export, a compare_zero row and host syncs. Every run trains on short documents with
document masking (every window holds boundaries, so attention across documents would change the losses) and the
chunked loss, in fp32."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
from helpers import assert_same_run, metric_rows, ROOT, TINY_OVERRIDES, run_script, run_train


pytestmark = pytest.mark.slow

SP_STEPS = 10
TOL = 1e-5
COMMON = ("train.loss_chunk_tokens=24", "checkpoint.every_steps=5", "train.eval_every_steps=5",
          "checkpoint.export_at_end=true", "checkpoint.export_dtype=fp32")
SP2 = ("distributed.sequence_parallel_size=2",)


@pytest.fixture(scope="module")
def sp_runs(tmp_path_factory, short_docs):
    """Runs of SP_STEPS steps, once per module: {name: run folder}."""
    root = tmp_path_factory.mktemp("sp_runs")
    cache: dict[str, Path] = {}

    def get(name: str, overrides: tuple[str, ...], nproc: int) -> Path:
        if name not in cache:
            out = root / name
            run_train(out, short_docs, [f"train.max_steps={SP_STEPS}", *COMMON, *overrides], nproc=nproc)
            cache[name] = out
        return cache[name]

    return get


def reference(sp_runs) -> Path:
    return sp_runs("reference", ("distributed.deepspeed_config=zero1",), nproc=1)


@pytest.mark.parametrize("ds", ["zero1", "zero2"])
def test_two_ranks_sharing_each_window_train_like_one_process(sp_runs, ds):
    """Same losses, gradient norms (DeepSpeed reduces a group's gradients differently per stage) and validation
    losses over 10 steps; ZeRO-1 with activation checkpointing."""
    extra = ("train.gradient_checkpointing=true",) if ds == "zero1" else ()
    run = sp_runs(f"sp2-{ds}", (f"distributed.deepspeed_config={ds}", *SP2, *extra), nproc=2)
    assert_same_run(run, reference(sp_runs), TOL)
    meta = json.loads((run / "run_meta.json").read_text())
    assert meta["config"]["distributed"]["sequence_parallel_size"] == 2


def test_a_sequence_parallel_checkpoint_resumes_on_one_process_and_exports_the_same_weights(sp_runs, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    source = sp_runs("sp2-zero2", ("distributed.deepspeed_config=zero2", *SP2), nproc=2)
    out = tmp_path / "resumed"
    proc = run_train(out, _data_of(source), [f"train.max_steps={SP_STEPS}", *COMMON, "distributed.deepspeed_config=zero1",
                                             f"checkpoint.resume={source / 'checkpoints' / 'step_00000005'}"])
    assert "sequence parallel 2 -> 1" in proc.stderr
    assert_same_run(out, reference(sp_runs), TOL, first_step=6)
    # The export of the sequence-parallel run is a plain Hugging Face folder with the reference's weights.
    exported, expected = (load_file(run / "export" / "model-00001-of-00001.safetensors")
                          for run in (source, reference(sp_runs)))
    assert exported.keys() == expected.keys()
    # Adam divides by the root of the second moment: on a rarely seen token's embedding row (moments near Adam's
    # epsilon) a gradient difference of float rounding, from summing the two ranks' halves in another order, moves
    # the weight by a fraction of one step (lr 2e-3; 2.1e-4 seen on one weight). So: nearly every weight within
    # 1e-5, and none beyond half a step.
    diffs = torch.cat([(exported[k] - expected[k]).abs().flatten() for k in expected])
    assert (diffs > 1e-5).sum().item() <= 1e-4 * diffs.numel(), (diffs > 1e-5).sum().item()
    assert diffs.max().item() <= 1e-3
    AutoModelForCausalLM.from_pretrained(source / "export")


def _data_of(run: Path) -> Path:
    return Path(json.loads((run / "run_meta.json").read_text())["config"]["data"]["path"])


def test_compare_zero_runs_a_sequence_parallel_row(sp_runs, tmp_path):
    """``zero3+sp2``: ZeRO-3 (whose reduce-scatter averages over every rank) under sequence parallelism."""
    ref = reference(sp_runs)
    out = tmp_path / "compare"
    run_script(["tools/compare_zero.py", "recipes/tiny.yaml", *TINY_OVERRIDES, f"data.path={_data_of(ref)}",
                "train.loss_chunk_tokens=24", "--configs", "zero3+sp2", "--steps", "4", "--nproc", "2", "--out",
                str(out)])
    with open(out / "results.csv") as f:
        (row,) = list(csv.DictReader(f))
    assert row["config"] == "zero3+sp2" and row["status"] == "ok"
    got, want = metric_rows(out / "zero3+sp2", "loss"), metric_rows(ref, "loss")
    assert sorted(got) == [1, 2, 3, 4] and max(abs(got[s] - want[s]) for s in got) <= TOL
    got, want = metric_rows(out / "zero3+sp2", "grad_norm"), metric_rows(ref, "grad_norm")
    assert max(abs(got[s] - want[s]) / want[s] for s in got) <= TOL


def test_sequence_parallelism_adds_no_host_sync_to_an_unlogged_step(tmp_path, short_docs):
    """Two runs whose sync points are step 1 and the last differ by 8 unlogged steps: their difference holds only
    DeepSpeed's own check of the gradient norm (``is_invalid_grad_norm``), none from the recipe or Ulysses."""
    counts = {}
    for steps in (3, 11):
        out = tmp_path / f"steps{steps}"
        args = [str(ROOT / "tests" / "integration" / "host_sync_probe.py"), str(out / "counts.json"),
                "recipes/tiny.yaml", f"out_dir={out}", f"data.path={short_docs}", *TINY_OVERRIDES,
                f"train.max_steps={steps}", "logging.log_every_steps=1000", "train.eval_every_steps=0",
                "checkpoint.every_steps=0", "checkpoint.resume=none", "distributed.deepspeed_config=zero1", *SP2]
        out.mkdir()
        run_script(args, nproc=2)
        counts[steps] = json.loads((out / "counts.rank0.json").read_text())["sources"]
    added = {k: counts[11].get(k, 0) - counts[3].get(k, 0) for k in counts[11]}
    added = {k: v for k, v in added.items() if v}
    assert set(added) == {"deepspeed/runtime/utils.py:is_invalid_grad_norm"}, added
