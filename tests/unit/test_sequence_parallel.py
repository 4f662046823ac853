"""Sequence parallelism without processes: each rank's share of a window, the refusals that name the fix, the
layout a checkpoint records, compare_zero's +spN rows, an evaluation forward after Ulysses replicated the key/value
heads."""

from __future__ import annotations

import pytest
import torch
from helpers import ROOT, TINY_OVERRIDES, write_data

from lmrecipe.planning.zero_comparison import config_label, config_overrides, ds_config_path
from lmrecipe.config import load_config
from lmrecipe.data.batches import BatchLayout
from lmrecipe.parallel.deepspeed_config import check_sequence_parallel_stage, load_deepspeed_config
from lmrecipe.parallel.splits import SequenceParallel, check_sequence_parallel_model, name_sequence_parallel_attention
from lmrecipe.parallel.topology import Topology, ZeroSetup, check_sequence_parallel_topology
from lmrecipe.errors import UserError
from lmrecipe.model.build import build_hf_config


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
    saved, now = Topology(2, zero, 2), Topology(2, zero, 1)
    assert now.changes_from(saved) == ["sequence parallel 2 -> 1"] and now.needs_conversion_from(saved)
    assert Topology.from_record(saved.record()) == saved
    older = {"world_size": 2, "deepspeed": True, "zero_stage": 2}  # written before the key existed
    assert Topology.from_record(older).sequence_parallel_size == 1


def test_compare_zero_configs_take_a_sequence_parallel_option():
    assert config_overrides("zero3+sp2") == ["distributed.sequence_parallel_size=2"]
    assert ds_config_path("zero3+sp2").endswith("ds_configs/zero3.json") and config_label("zero3+sp2") == "zero3+sp2"
    with pytest.raises(UserError, match=r"\+spN"):
        config_overrides("zero3+fast")


def test_the_long_context_recipe_fits_eight_80gb_gpus_by_the_estimate():
    from lmrecipe.planning.zero_comparison import estimate_config
    from lmrecipe.planning.memory import model_shape

    def device_total(*overrides: str) -> float:
        cfg = load_config(ROOT / "recipes" / "llama3_8b_long.yaml", ["model.init_from=null", "model.vocab_size=128256",
                                                                   *overrides])
        shape = model_shape(build_hf_config(cfg.model, 128_256, cfg.data.seq_len))
        return estimate_config(cfg.workload(), shape, "ds_configs/zero3.json", 8, 1, "bf16").device_total

    recipe = device_total()
    assert recipe < 80e9 * 0.5  # headroom for what the estimate leaves out (allocator, communication buffers)
    assert recipe < device_total("distributed.sequence_parallel_size=1") < device_total(
        "distributed.sequence_parallel_size=1", "train.loss_chunk_tokens=0")


def test_fewer_key_value_heads_than_ranks_load_and_evaluate_with_every_head():
    """sp=2 over one key/value head: Ulysses replicates it and, inside each training forward, rewrites the attention
    modules' ``num_key_value_groups`` to its per-rank count (DeepSpeed's ``UlyssesSPAttentionHF.forward``) without
    restoring it. An evaluation forward (validation, the checkpoint's probe) runs unsplit on every head and must see
    the model's own count again."""
    from types import SimpleNamespace

    from lmrecipe.model.build import build_model

    load_config(ROOT / "recipes" / "tiny.yaml", [*TINY_OVERRIDES, ZERO1, "distributed.sequence_parallel_size=2",
                                                 "model.num_kv_heads=1"])  # not refused: it trains
    # eager repeats the key/value heads by that count in every forward, as the masked paths of sdpa do (document
    # masking); unmasked sdpa leaves the repeat to torch and would not notice.
    cfg = load_config(ROOT / "recipes" / "tiny.yaml", [*TINY_OVERRIDES, "model.num_kv_heads=1",
                                                       "model.attn_implementation=eager", "data.document_masking=false"])
    torch.manual_seed(0)
    model = build_model(cfg.model, cfg.train, build_hf_config(cfg.model, 384, cfg.data.seq_len)).eval()
    ids = torch.randint(0, 384, (2, cfg.data.seq_len))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    handler = SimpleNamespace(sp_attn_implementation="sdpa")
    accelerator = SimpleNamespace(parallelism_config=SimpleNamespace(sp_size=2, sp_handler=handler))
    name_sequence_parallel_attention(accelerator, model)
    assert handler.sp_attn_implementation == model.config._attn_implementation
    attention = [m for m in model.modules() if hasattr(m, "num_key_value_groups")]
    assert attention and all(m.num_key_value_groups == 4 for m in attention)
    for module in attention:  # what a training forward under Ulysses leaves: 2 query heads per rank, 1 key/value
        module.num_key_value_groups = 2
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, expected)


def ds_config(name: str, precision: str) -> dict:
    cfg = load_config(ROOT / "recipes" / "tiny.yaml", [*TINY_OVERRIDES, ZERO1, "distributed.sequence_parallel_size=2"])
    return load_deepspeed_config(ROOT / "ds_configs" / f"{name}.json", cfg.optim, cfg.distributed,
                                 BatchLayout.from_config(cfg.train, 1), precision)


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_bf16_sequence_parallelism_under_zero1_is_refused_with_the_stages_that_work(precision):
    """DeepSpeed's bf16 ZeRO-1 optimizer fails at step 1 under Ulysses ("stack expects a non-empty TensorList");
    fp8 trains on the same optimizer. ZeRO-2 and ZeRO-3 (and fp32) train like one process."""
    with pytest.raises(UserError, match="Choose distributed.deepspeed_config=zero2 or zero3") as err:
        check_sequence_parallel_stage(2, ds_config("zero1", precision), precision, "ds_configs/zero1.json", precision)
    assert err.value.exit_code == 2 and "train.precision=fp32" in str(err.value)
    with pytest.raises(UserError, match=r"train.precision=auto \(bf16 here\)"):  # auto is bf16 on a GPU
        check_sequence_parallel_stage(2, ds_config("zero1", "bf16"), "bf16", "ds_configs/zero1.json", "auto")
    for name in ("zero2", "zero3"):
        check_sequence_parallel_stage(2, ds_config(name, precision), precision, f"ds_configs/{name}.json", precision)
    check_sequence_parallel_stage(2, ds_config("zero1", "fp32"), "fp32", "ds_configs/zero1.json", "fp32")
    check_sequence_parallel_stage(1, ds_config("zero1", precision), precision, "ds_configs/zero1.json", precision)


def test_the_bf16_zero1_refusal_comes_before_any_process_group_or_file(tmp_path, monkeypatch):
    from lmrecipe.train.setup import build_run

    monkeypatch.setenv("WORLD_SIZE", "2")  # as the launcher announces it; no process group is formed
    out = tmp_path / "run"
    cfg = load_config(ROOT / "recipes" / "tiny.yaml", [
        *TINY_OVERRIDES, ZERO1, "distributed.sequence_parallel_size=2", "train.precision=bf16", f"out_dir={out}",
        f"data.path={write_data(tmp_path / 'data')}"])
    with pytest.raises(UserError, match="cannot run under ZeRO-1"):
        build_run(cfg, out)
    assert not out.exists()
