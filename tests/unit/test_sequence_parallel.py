"""Sequence parallelism without processes: each rank's share of a window, the refusals that name the fix, the
layout a checkpoint records, compare_zero's +spN rows."""

from __future__ import annotations

import pytest
import torch
from helpers import ROOT, TINY_OVERRIDES

from lmrecipe.compare import config_label, config_overrides, ds_config_path
from lmrecipe.config import load_config
from lmrecipe.distributed import (
    Layout,
    SequenceParallel,
    ZeroSetup,
    check_sequence_parallel_model,
    check_sequence_parallel_topology,
)
from lmrecipe.errors import UserError
from lmrecipe.model import build_hf_config


def test_each_rank_holds_its_slice_of_tokens_and_positions():
    inputs = torch.arange(16).view(2, 8)
    targets = inputs + 100
    parts = [SequenceParallel(4, rank).shard(inputs, targets, {}, "cpu") for rank in range(4)]
    assert torch.equal(torch.cat([p[0] for p in parts], dim=1), inputs)
    assert torch.equal(torch.cat([p[1] for p in parts], dim=1), targets)
    # Whole-window positions, so the attention (which gathers them) sees one causal sequence.
    assert torch.equal(torch.cat([p[2]["position_ids"] for p in parts], dim=1), torch.arange(8).expand(2, -1))
    # Document masking: positions restart at documents and are sliced; the mask stays whole.
    mask = torch.ones(2, 1, 8, 8, dtype=torch.bool)
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2]] * 2)
    _, _, kwargs = SequenceParallel(2, 1).shard(inputs, targets, {"position_ids": positions, "document_mask": mask}, "cpu")
    assert torch.equal(kwargs["position_ids"], positions[:, 4:]) and kwargs["document_mask"] is mask


def test_the_loss_divisor_follows_how_deepspeed_reduces_each_stage():
    def divisor(zero: dict) -> int:
        return SequenceParallel.of_rank(2, 3, {"zero_optimization": zero}).loss_divisor

    assert SequenceParallel.of_rank(2, 3, {}).rank == 1
    assert divisor({"stage": 1}) == 2 and divisor({"stage": 2}) == 2
    assert divisor({"stage": 3}) == 1 and divisor({"stage": 3, "reduce_scatter": False}) == 2


ZERO1 = "distributed.deepspeed_config=zero1"


def test_sequence_parallelism_without_deepspeed_is_refused_when_the_recipe_loads():
    sp2 = [*TINY_OVERRIDES, "distributed.sequence_parallel_size=2"]
    with pytest.raises(UserError, match="distributed.deepspeed_config=zero1"):
        load_config(ROOT / "recipes" / "tiny.yaml", sp2)
    load_config(ROOT / "recipes" / "tiny.yaml", [*sp2, ZERO1])


def test_launches_that_cannot_share_windows_are_refused():
    with pytest.raises(UserError, match="Launch a multiple of 2 processes"):
        check_sequence_parallel_topology(2, 3)
    check_sequence_parallel_topology(1, 3)
    check_sequence_parallel_topology(2, 4)


@pytest.mark.parametrize("overrides, fix", [
    (["distributed.sequence_parallel_size=3", "model.num_heads=4"], "must divide the attention heads"),
    (["distributed.sequence_parallel_size=2", "data.seq_len=33"], "multiple of 2"),
    (["distributed.sequence_parallel_size=2", "model.attn_implementation=eager"], "attn_implementation=sdpa"),
])
def test_models_and_windows_that_cannot_be_split_are_refused(overrides, fix):
    with pytest.raises(UserError, match=fix):
        load_config(ROOT / "recipes" / "tiny.yaml", [*TINY_OVERRIDES, ZERO1, *overrides])


def test_a_continued_model_whose_heads_do_not_split_is_refused_once_its_config_is_read():
    cfg = load_config(ROOT / "recipes" / "tiny.yaml", [*TINY_OVERRIDES, "model.num_heads=4"])
    with pytest.raises(UserError, match="must divide the attention heads"):
        check_sequence_parallel_model(3, build_hf_config(cfg.model, 384, cfg.data.seq_len))
    check_sequence_parallel_model(2, build_hf_config(cfg.model, 384, cfg.data.seq_len))


def test_a_change_of_sequence_parallel_size_is_a_layout_change():
    zero = ZeroSetup(stage=2, deepspeed=True)
    saved, now = Layout.of_run(2, zero, 2), Layout.of_run(2, zero, 1)
    assert now.changes_from(saved) == ["sequence parallel 2 -> 1"] and now.needs_conversion_from(saved)
    assert Layout.from_topology(saved.to_dict()) == saved
    older = {"world_size": 2, "deepspeed": True, "zero_stage": 2}  # written before the key existed
    assert Layout.from_topology(older).sequence_parallel_size == 1


def test_compare_zero_configs_take_a_sequence_parallel_option():
    assert config_overrides("zero3+sp2") == ["distributed.sequence_parallel_size=2"]
    assert ds_config_path("zero3+sp2").endswith("ds_configs/zero3.json") and config_label("zero3+sp2") == "zero3+sp2"
    with pytest.raises(UserError, match=r"\+spN"):
        config_overrides("zero3+fast")


def test_the_long_context_recipe_fits_eight_80gb_gpus_by_the_estimate():
    from lmrecipe.compare import estimate_config
    from lmrecipe.memory import model_shape

    def device_total(*overrides: str) -> float:
        cfg = load_config(ROOT / "recipes" / "llama3_8b_long.yaml", ["model.init_from=null", "model.vocab_size=128256",
                                                                   *overrides])
        shape = model_shape(build_hf_config(cfg.model, 128_256, cfg.data.seq_len))
        return estimate_config(cfg.workload(), shape, "ds_configs/zero3.json", 8, 1, "bf16").device_total

    recipe = device_total()
    assert recipe < 80e9 * 0.5  # headroom for what the estimate leaves out (allocator, communication buffers)
    assert recipe < device_total("distributed.sequence_parallel_size=1") < device_total(
        "distributed.sequence_parallel_size=1", "train.loss_chunk_tokens=0")
