"""Mixture-of-experts runs (docs/moe.md): DeepSpeed AutoEP's expert parallelism equals one process, on every ZeRO
stage; its checkpoints resume onto another expert-parallel size, process count and ZeRO stage with the uninterrupted
run's losses, and export (ZeRO-1 and ZeRO-3) to the run's validation loss; the model class's own MoE block trains
under ZeRO-3 (leaf modules). Each run happens once per session (``cached_run``)."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import LOSS_TOL, assert_same_run, cached_run, metric_rows, run_script, run_train

from lmrecipe.checkpoint.portable import META_FILE, portable_dir
from lmrecipe.checkpoint.readers import open_source
from lmrecipe.checkpoint.storage import DS_TAG, step_dir_name
from lmrecipe.observe.metrics_log import read_metrics

STEPS, HALF = 10, 5
MOE = ["model.arch=qwen3_moe", "model.num_experts=4", "model.experts_per_token=2", "model.hidden_size=32",
       "model.intermediate_size=64", "model.expert_intermediate_size=32", f"train.max_steps={STEPS}",
       "train.eval_every_steps=5", "train.precision=fp32"]
EXPORTED = ((1, 2), (3, 2))
"""(stage, expert-parallel size) of the AutoEP runs that export their experts gathered (fp32) at the end."""


def autoep_run(tmp_path_factory, data, stage: int, ep: int):
    """AutoEP at size ``ep`` on ``ep`` processes under ZeRO-``stage``, saving at step HALF (resumed on other layouts)
    and at the end; expert parallelism under ZeRO-1 and ZeRO-3 exports at the end."""
    export = ["checkpoint.export_at_end=true", "checkpoint.export_dtype=fp32"] if (stage, ep) in EXPORTED else []
    return cached_run(tmp_path_factory, f"moe_ep{ep}_zero{stage}", data, [
        *MOE, f"checkpoint.every_steps={HALF}", f"distributed.deepspeed_config=zero{stage}",
        "distributed.expert_layer=autoep", f"distributed.expert_parallel_size={ep}", *export], nproc=ep)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_data):
    """One process, AutoEP at size 1 (every expert on the rank), ZeRO-1."""
    return autoep_run(tmp_path_factory, tiny_data, 1, 1)[0]


@pytest.fixture(scope="module")
def hf_zero3(tmp_path_factory, tiny_data):
    """The model class's own MoE block on 2 processes under ZeRO-3 (no AutoEP)."""
    return cached_run(tmp_path_factory, "moe_hf_zero3", tiny_data, [*MOE, "checkpoint.every_steps=0",
                                                                     "distributed.deepspeed_config=zero3"], nproc=2)[0]


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
@pytest.mark.parametrize("stage", [1, 3])
def test_the_export_gathers_the_experts_and_evaluates_to_the_runs_validation_loss(tmp_path_factory, tiny_data, stage):
    run, _ = autoep_run(tmp_path_factory, tiny_data, stage, 2)
    export = run / "export"
    config = json.loads((export / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe" and config.get("num_experts", config.get("num_local_experts")) == 4
    # eval.py loads the folder with AutoModelForCausalLM.from_pretrained: every expert of the class's layout is there.
    proc = run_script(["eval.py", str(export), "--data", str(tiny_data), "--max-batches", "2", "--batch-size", "8"])
    result = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("{")))
    val_loss = metric_rows(run, "val_loss")[STEPS]
    assert result["loss"] == pytest.approx(val_loss, rel=1e-6)


RESUMES = {
    # name: (source run (ZeRO stage, expert-parallel size = processes), resumed run (the same), the change logged)
    "ep2-zero3-2p-to-ep1-zero1-1p": ((3, 2), (1, 1), "processes 2 -> 1; ZeRO-3 -> ZeRO-1; expert parallel 2 -> 1"),
    "ep1-zero1-1p-to-ep2-zero3-2p": ((1, 1), (3, 2), "processes 1 -> 2; ZeRO-1 -> ZeRO-3; expert parallel 1 -> 2"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(RESUMES))
def test_resume_onto_another_expert_parallel_size_continues_the_losses(tmp_path, tmp_path_factory, tiny_data, case):
    (stage, ep), (new_stage, new_ep), change = RESUMES[case]
    source, _ = autoep_run(tmp_path_factory, tiny_data, stage, ep)
    checkpoint = source / "checkpoints" / step_dir_name(HALF)
    out = tmp_path / "run"
    proc = run_train(out, tiny_data, [*MOE, "checkpoint.every_steps=0", f"checkpoint.resume={checkpoint}",
                                      f"distributed.deepspeed_config=zero{new_stage}", "distributed.expert_layer=autoep",
                                      f"distributed.expert_parallel_size={new_ep}"], nproc=new_ep)
    assert f"on a new layout: {change}." in proc.stderr
    assert sorted(metric_rows(out, "loss")) == list(range(HALF + 1, STEPS + 1))
    got, want = metric_rows(out, "loss"), metric_rows(source, "loss")
    print(f"{case}: max |loss difference| after resume = {max(abs(got[s] - want[s]) for s in got):.3g}")
    assert_same_run(out, source, LOSS_TOL, first_step=HALF + 1)
    # The topology-free form holds every expert whole, under the AutoEP parameter's own name.
    params = json.loads((portable_dir(checkpoint) / META_FILE).read_text())["params"]
    assert params["model.layers.1.mlp.experts.w2"] == [4, 32, 32]


@pytest.mark.slow
def test_the_reader_puts_each_ranks_experts_in_their_rows(tmp_path_factory, tiny_data):
    """ZeRO-1 at expert-parallel size 2 keeps each rank's experts in its own optimizer shard (its MoE group, not
    partitioned over the other rank): the whole tensor read is the ranks' fragments in expert order, and its fp32
    weights are AutoEP's files of one expert each."""
    run, _ = autoep_run(tmp_path_factory, tiny_data, 1, 2)
    ds_dir = run / "checkpoints" / step_dir_name(HALF) / DS_TAG
    name = "model.layers.1.mlp.experts.w2"
    source = open_source(ds_dir.parent, deepspeed_dir=ds_dir, param_names=[])
    try:
        read = {key: source.read(key, name) for key in ("fp32", "exp_avg", "exp_avg_sq")}
        assert source.shapes[name] == (4, 32, 32) and set(source.steps.values()) == {HALF}
    finally:
        source.close()
    for rank in (0, 1):  # rank r holds experts 2r and 2r + 1
        osd = torch.load(ds_dir / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt", map_location="cpu",
                         weights_only=False)["optimizer_state_dict"]
        group = next(g for g, mapping in enumerate(osd["param_slice_mappings"]) if name in mapping)
        address = osd["param_slice_mappings"][group][name]
        flats = {"fp32": osd["single_partition_of_fp32_groups"][group],
                 **{k: osd["base_optimizer_state"]["state"][group][k] for k in ("exp_avg", "exp_avg_sq")}}
        for key, flat in flats.items():
            assert torch.equal(read[key][2 * rank:2 * rank + 2].reshape(-1), flat.narrow(0, address.start, address.numel))
    for expert in range(4):
        weights = torch.load(ds_dir / f"layer_1_expert_{expert}_mp_rank_00_model_states.pt", weights_only=False)
        assert torch.equal(read["fp32"][expert], weights[f"model.layers.1.mlp.experts.w2.{expert}"])
    assert read["exp_avg_sq"].abs().sum() > 0
