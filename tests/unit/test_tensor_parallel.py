"""Tensor parallelism (DeepSpeed AutoTP) without processes: the refusals that name the fix, the DeepSpeed config,
the layout a checkpoint records, merging and slicing the split parameters, the memory estimate and compare_zero's
+tpN rows."""

from __future__ import annotations

import pytest
import torch
from helpers import ROOT, TINY_OVERRIDES

from lmrecipe.checkpoint.tp_split import full_shape, local_slice, merge
from lmrecipe.planning.zero_comparison import config_overrides, estimate_config
from lmrecipe.config import load_config
from lmrecipe.data.batches import BatchLayout
from lmrecipe.parallel.deepspeed_config import check_tensor_parallel_stage, load_deepspeed_config
from lmrecipe.parallel.splits import check_tensor_parallel_model
from lmrecipe.parallel.topology import Topology, ZeroSetup, check_tensor_parallel_topology
from lmrecipe.errors import UserError
from lmrecipe.planning.memory import model_shape
from lmrecipe.model.build import build_hf_config

TINY = ROOT / "recipes" / "tiny.yaml"
TP2 = "distributed.tensor_parallel_size=2"
ZERO1 = "distributed.deepspeed_config=zero1"


@pytest.mark.parametrize("override, fix", [
    ("distributed.sequence_parallel_size=2", "one of the two splits"),
    ("train.ema_decay=0.99", "train.ema_decay=0"),
    ("eval.tasks=[next_line]", "eval.tasks=\\[\\]"),
    ("optim.name=muon", "optim.name=adamw"),
    ("train.precision=fp8", "train.precision=bf16"),
    ("train.compile=layers", "train.compile=none"),
])
def test_settings_tensor_parallelism_does_not_support_are_refused(override, fix):
    deepspeed = [ZERO1, "optim.grad_clip=0"]  # Muon under DeepSpeed trains unclipped
    with pytest.raises(UserError, match=fix) as err:
        load_config(TINY, [*TINY_OVERRIDES, *deepspeed, TP2, override])
    assert "distributed.tensor_parallel_size=1" in str(err.value)
    load_config(TINY, [*TINY_OVERRIDES, *deepspeed, override])  # each is fine on its own


def test_tensor_parallelism_without_deepspeed_is_refused_when_the_recipe_loads():
    with pytest.raises(UserError, match="runs through DeepSpeed AutoTP: choose a DeepSpeed config with ZeRO 0-2"):
        load_config(TINY, [*TINY_OVERRIDES, TP2])
    load_config(TINY, [*TINY_OVERRIDES, TP2, ZERO1])


def test_launches_that_cannot_split_the_model_are_refused():
    with pytest.raises(UserError, match="Launch a multiple of 2 processes"):
        check_tensor_parallel_topology(2, 3)
    check_tensor_parallel_topology(1, 3)
    check_tensor_parallel_topology(2, 4)


def test_zero3_is_refused_and_stages_up_to_2_are_not():
    with pytest.raises(UserError, match="ZeRO stages 0-2"):
        check_tensor_parallel_stage(2, ZeroSetup(stage=3, deepspeed=True), "ds_configs/zero3.json")
    for stage in (1, 2):
        check_tensor_parallel_stage(2, ZeroSetup(stage=stage, deepspeed=True), f"ds_configs/zero{stage}.json")


@pytest.mark.parametrize("overrides", [
    ["distributed.tensor_parallel_size=3", "model.num_heads=3", "model.hidden_size=48", "model.intermediate_size=128"],
    ["distributed.tensor_parallel_size=2", "model.num_kv_heads=1"],
    ["distributed.tensor_parallel_size=2", "model.intermediate_size=129"],
])
def test_models_whose_matrices_do_not_split_evenly_are_refused(overrides):
    with pytest.raises(UserError, match="must divide the attention heads"):
        load_config(TINY, [*TINY_OVERRIDES, ZERO1, *overrides])
    # A model continued from model.init_from has its checkpoint's shape, checked once its config.json is read.
    tp = int(overrides[0].partition("=")[2])
    shape = load_config(TINY, [*TINY_OVERRIDES, *overrides[1:]])
    with pytest.raises(UserError, match="must divide the attention heads"):
        check_tensor_parallel_model(tp, build_hf_config(shape.model, 384, shape.data.seq_len))
    good = load_config(TINY, [*TINY_OVERRIDES, ZERO1, TP2])
    check_tensor_parallel_model(2, build_hf_config(good.model, 384, good.data.seq_len))


def test_the_deepspeed_config_turns_on_autotp_and_counts_every_rank_in_its_batch_check():
    cfg = load_config(TINY, [*TINY_OVERRIDES, ZERO1, TP2])  # global batch 8, micro-batch 4
    layout = BatchLayout.from_config(cfg.train, 2)  # 4 processes: 2 data-parallel ranks
    ds = load_deepspeed_config("ds_configs/zero1.json", cfg.optim, cfg.distributed, layout, "fp32")
    assert ds["tensor_parallel"] == {"autotp_size": 2}
    # DeepSpeed checks train_batch = micro x accumulation x all ranks; the two ranks of a group read the same samples.
    assert ds["train_batch_size"] == 16 == ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * 4
    plain = load_config(TINY, TINY_OVERRIDES)
    assert "tensor_parallel" not in load_deepspeed_config("ds_configs/zero1.json", plain.optim, plain.distributed,
                                                          layout, "fp32")


def test_a_change_of_tensor_parallel_size_is_a_layout_change():
    zero = ZeroSetup(stage=1, deepspeed=True)
    saved, now = Topology(2, zero, 1, 2), Topology(2, zero, 1, 1)
    assert now.changes_from(saved) == ["tensor parallel 2 -> 1"] and now.needs_conversion_from(saved)
    assert Topology.from_record(saved.record()) == saved
    older = {"world_size": 2, "deepspeed": True, "zero_stage": 1}  # written before the key existed
    assert Topology.from_record(older).tensor_parallel_size == 1


def test_slices_merge_into_the_whole_and_each_rank_takes_its_own_back():
    whole = torch.arange(7 * 4, dtype=torch.float32).view(7, 4)
    for split in ({"dim": 0, "sizes": [4, 3]}, {"dim": 1, "sizes": [1, 3]}):
        pieces = [local_slice(whole, split, rank) for rank in range(2)]
        assert [p.shape[split["dim"]] for p in pieces] == split["sizes"]
        assert full_shape(pieces[1].shape, split) == (7, 4)
        assert torch.equal(merge(pieces, split), whole)
    assert merge([whole, whole + 1], None) is whole  # not split: rank 0's copy
    with pytest.raises(UserError, match="written by different code"):
        merge([whole[:3], whole[3:]], {"dim": 0, "sizes": [4, 3]})


def test_the_estimate_splits_the_matrices_and_the_activations_between_them():
    cfg = load_config(ROOT / "recipes" / "llama_1b.yaml", ["model.init_from=null", "model.vocab_size=32000"])
    shape = model_shape(build_hf_config(cfg.model, 32_000, cfg.data.seq_len))
    linear = shape.tp_split_params
    embedding = shape.vocab_size * shape.hidden_size
    norms = (2 * shape.num_layers + 1) * shape.hidden_size
    assert shape.n_params == linear + embedding + norms  # untied: every matrix but the embedding splits

    def estimate(*overrides: str):
        run = load_config(ROOT / "recipes" / "llama_1b.yaml", ["model.init_from=null", "model.vocab_size=32000",
                                                               "train.global_batch_size=64", *overrides])
        return estimate_config(run.workload(), shape, "ds_configs/zero2.json", 8, 1, "bf16")

    plain, tp2 = estimate(), estimate(TP2)
    # bf16 ZeRO-2: 2 bytes of weights whole, the other 18 over the data-parallel ranks (4 of them under tp=2).
    held = shape.n_params - linear / 2
    assert tp2.weights == pytest.approx(2 * held)
    assert tp2.model_states == pytest.approx(2 * held + 18 * held / 4)
    assert plain.model_states == pytest.approx(2 * shape.n_params + 18 * shape.n_params / 8)
    assert plain.activations_checkpointed > tp2.activations_checkpointed > plain.activations_checkpointed / 2
    assert config_overrides("zero2+tp2") == [TP2]
