"""Tensor parallelism (DeepSpeed AutoTP) on 2 processes against 1 process without it: losses, gradient norms and
validation over 10 steps; the checkpoint's recorded splits; resume on the same layout and through the
topology-free form in both directions; the export and eval.py's consolidation of the slices.
Every run trains in fp32."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import assert_same_run, metric_rows, run_script, run_train

from lmrecipe.export import checkpoint_state_dict

pytestmark = pytest.mark.slow

STEPS = 10
TOL = 1e-5
COMMON = ("checkpoint.every_steps=5", "train.eval_every_steps=5", "checkpoint.export_at_end=true",
          "checkpoint.export_dtype=fp32")
TP2 = ("distributed.tensor_parallel_size=2",)


@pytest.fixture(scope="module")
def tp_runs(tmp_path_factory, tiny_data):
    """Runs of STEPS steps, once per module: {name: run folder}."""
    root = tmp_path_factory.mktemp("tp_runs")
    cache: dict[str, Path] = {}

    def get(name: str, overrides: tuple[str, ...], nproc: int) -> Path:
        if name not in cache:
            out = root / name
            proc = run_train(out, tiny_data, [f"train.max_steps={STEPS}", *COMMON, *overrides], nproc=nproc)
            (root / f"{name}.log").write_text(proc.stderr)
            cache[name] = out
        return cache[name]

    return get


def reference(tp_runs) -> Path:
    return tp_runs("reference", ("distributed.deepspeed_config=zero1",), nproc=1)


def tp2(tp_runs) -> Path:
    return tp_runs("tp2-zero1", ("distributed.deepspeed_config=zero1", *TP2), nproc=2)


def test_two_ranks_splitting_each_matrix_train_like_one_process(tp_runs):
    run = tp2(tp_runs)
    assert_same_run(run, reference(tp_runs), TOL)
    state = json.loads((run / "checkpoints" / "step_00000010" / "train_state.json").read_text())
    assert state["topology"]["tensor_parallel_size"] == 2
    # Every linear layer is split: q/k/v/gate/up and the output layer by rows, o/down by columns, in halves.
    splits = state["tensor_parallel"]
    assert len(splits) == 2 * 7 + 1
    assert splits["model.layers.0.self_attn.q_proj.weight"] == {"dim": 0, "sizes": [32, 32]}
    assert splits["model.layers.1.mlp.down_proj.weight"] == {"dim": 1, "sizes": [64, 64]}
    assert splits["lm_head.weight"]["dim"] == 0
    ds_files = sorted(p.name for p in (run / "checkpoints" / "step_00000010" / "pytorch_model").iterdir())
    assert [f for f in ds_files if "mp_rank_01" in f], ds_files  # one set of files per tensor-parallel rank


def test_the_export_and_eval_consolidate_the_slices_into_the_reference_weights(tp_runs, tiny_data):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    run, ref = tp2(tp_runs), reference(tp_runs)
    exported, expected = (load_file(r / "export" / "model-00001-of-00001.safetensors") for r in (run, ref))
    assert exported.keys() == expected.keys()
    for name, value in expected.items():
        assert exported[name].shape == value.shape, name
    # Adam on a rarely seen token's row turns float rounding into a fraction of one step (lr ~2e-3): nearly every
    # weight within 1e-5, none beyond 1e-4 (as sequence parallelism's export test).
    diffs = torch.cat([(exported[k] - expected[k]).abs().flatten() for k in expected])
    assert (diffs > 1e-5).sum().item() <= 1e-4 * diffs.numel() and diffs.max().item() <= 1e-4
    AutoModelForCausalLM.from_pretrained(run / "export")
    # eval.py reads the checkpoint itself (DeepSpeed's zero_to_fp32 alone would see one rank's slices).
    ckpt = run / "checkpoints" / "step_00000010"
    whole = checkpoint_state_dict(ckpt, torch.float32)
    assert whole["model.layers.0.self_attn.q_proj.weight"].shape == (64, 64)
    proc = run_script(["eval.py", str(ckpt), "--data", str(tiny_data), "--max-batches", "4"])
    got = json.loads(proc.stdout.strip().splitlines()[-1])["loss"]
    proc = run_script(["eval.py", str(ref / "checkpoints" / "step_00000010"), "--data", str(tiny_data),
                       "--max-batches", "4"])
    assert abs(got - json.loads(proc.stdout.strip().splitlines()[-1])["loss"]) <= TOL


@pytest.mark.parametrize("name, overrides, nproc, source, change", [
    ("tp2-same", ("distributed.deepspeed_config=zero1", *TP2), 2, "tp2", None),
    ("tp2-to-1p", ("distributed.deepspeed_config=zero1",), 1, "tp2", "tensor parallel 2 -> 1"),
    ("1p-to-tp2-zero2", ("distributed.deepspeed_config=zero2", *TP2), 2, "reference", "tensor parallel 1 -> 2"),
], ids=["tp2-same-layout", "tp2-to-1p", "1p-to-tp2-zero2"])
def test_a_resume_continues_the_losses_exactly(tp_runs, tiny_data, tmp_path, name, overrides, nproc, source, change):
    """The same layout loads DeepSpeed's own files; a change of tensor-parallel size goes through the topology-free
    form (slices merged on the way in, each rank's slice taken on the way out)."""
    start = (tp2(tp_runs) if source == "tp2" else reference(tp_runs)) / "checkpoints" / "step_00000005"
    out = tmp_path / name
    proc = run_train(out, tiny_data, [f"train.max_steps={STEPS}", *COMMON, *overrides, f"checkpoint.resume={start}"],
                     nproc=nproc)
    if change is None:
        assert "on a new layout" not in proc.stderr
    else:
        assert change in proc.stderr
    assert_same_run(out, reference(tp_runs), TOL, first_step=6)
