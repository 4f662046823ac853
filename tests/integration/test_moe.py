"""Mixture-of-experts runs (docs/moe.md): DeepSpeed AutoEP's expert parallelism equals one process, on every ZeRO
stage; the model class's own MoE block trains under ZeRO-3 (leaf modules) and its export evaluates to the run's
validation loss. Each run happens once per session (``cached_run``)."""

from __future__ import annotations

import json

import pytest
from helpers import assert_same_run, cached_run, metric_rows, run_script

from lmrecipe.observe.metrics_log import read_metrics

STEPS = 10
MOE = ["model.arch=qwen3_moe", "model.num_experts=4", "model.experts_per_token=2", "model.hidden_size=32",
       "model.intermediate_size=64", "model.expert_intermediate_size=32", f"train.max_steps={STEPS}",
       "train.eval_every_steps=5", "checkpoint.every_steps=0", "train.precision=fp32"]


def autoep_run(tmp_path_factory, data, stage: int, ep: int):
    """AutoEP at size ``ep`` on ``ep`` processes under ZeRO-``stage``; expert parallelism under ZeRO-1 exports its
    experts gathered (fp32) at the end."""
    export = ["checkpoint.export_at_end=true", "checkpoint.export_dtype=fp32"] if (stage, ep) == (1, 2) else []
    return cached_run(tmp_path_factory, f"moe_ep{ep}_zero{stage}", data, [
        *MOE, f"distributed.deepspeed_config=zero{stage}", "distributed.expert_layer=autoep",
        f"distributed.expert_parallel_size={ep}", *export], nproc=ep)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_data):
    """One process, AutoEP at size 1 (every expert on the rank), ZeRO-1."""
    return autoep_run(tmp_path_factory, tiny_data, 1, 1)[0]


@pytest.fixture(scope="module")
def hf_zero3(tmp_path_factory, tiny_data):
    """The model class's own MoE block on 2 processes under ZeRO-3 (no AutoEP)."""
    return cached_run(tmp_path_factory, "moe_hf_zero3", tiny_data, [*MOE, "distributed.deepspeed_config=zero3"],
                      nproc=2)[0]


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_expert_parallel_2_equals_one_process(tmp_path_factory, tiny_data, reference, stage):
    run, stderr = autoep_run(tmp_path_factory, tiny_data, stage, 2)
    assert_same_run(run, reference, 1e-5)
    got, want = metric_rows(run, "aux_loss"), metric_rows(reference, "aux_loss")
    assert sorted(got) == list(range(1, STEPS + 1)) and max(abs(got[s] - want[s]) for s in want) <= 1e-6
    assert "AutoEP expert parallel 2: expert groups [0-1]" in stderr


@pytest.mark.slow
def test_moe_under_zero3_without_autoep_completes_within_1e_4_of_autoep(hf_zero3, reference):
    assert_same_run(hf_zero3, reference, 1e-4)


def test_router_loss_and_load_balance_are_logged_apart_from_the_lm_loss(reference):
    rows = read_metrics(reference / "metrics.jsonl")
    train = [r for r in rows if "loss" in r]
    assert len(train) == STEPS
    for row in train:
        assert 0 < row["aux_loss"] < 0.01  # 0.001 x the load-balancing loss (about experts_per_token when even)
        for layer in (0, 1):
            assert 1.0 <= row[f"load_balance/layer{layer}"] <= 4.0  # the busiest of 4 experts over the mean
    evals = [r for r in rows if "val_loss" in r]
    assert evals and not any("aux_loss" in r for r in evals)


@pytest.mark.slow
def test_the_export_gathers_the_experts_and_evaluates_to_the_runs_validation_loss(tmp_path_factory, tiny_data):
    run, _ = autoep_run(tmp_path_factory, tiny_data, 1, 2)
    export = run / "export"
    config = json.loads((export / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe" and config.get("num_experts", config.get("num_local_experts")) == 4
    # eval.py loads the folder with AutoModelForCausalLM.from_pretrained: every expert of the class's layout is there.
    proc = run_script(["eval.py", str(export), "--data", str(tiny_data), "--max-batches", "2", "--batch-size", "8"])
    result = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("{")))
    val_loss = metric_rows(run, "val_loss")[STEPS]
    assert result["loss"] == pytest.approx(val_loss, rel=1e-6)
