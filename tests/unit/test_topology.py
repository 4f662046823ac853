"""The run's topology: every parallel size decided once (``lmrecipe/parallel/topology.py``), and what is derived from
it: the data-parallel split of the batch, the checkpoint's record, the start-up line."""

from __future__ import annotations

import pytest

from lmrecipe.config import load_config
from lmrecipe.errors import UserError
from lmrecipe.parallel.launch import check_launch
from lmrecipe.parallel.topology import Topology, ZeroSetup, startup_line


def launch(world_size: int, *overrides: str):
    cfg = load_config("recipes/tiny.yaml", ["train.global_batch_size=16", "train.micro_batch_size=2", *overrides])
    return check_launch(cfg.workload(), cfg.distributed.deepspeed_config_path(), world_size, "fp32")


@pytest.mark.parametrize("overrides, dp, ranks", [
    ((), 4, "4 processes"),
    (("distributed.deepspeed_config=zero2", "distributed.sequence_parallel_size=2"), 2,
     "2 data-parallel groups of 2 ranks sharing each sequence"),
    (("distributed.deepspeed_config=zero1", "distributed.tensor_parallel_size=2"), 2,
     "2 data-parallel groups of 2 ranks splitting each matrix (AutoTP)"),
])
def test_the_batch_splits_over_the_data_parallel_ranks_only(overrides, dp, ranks):
    topology, batch, _ = launch(4, *overrides)
    assert topology.data_parallel_size == dp and batch.world_size == dp
    assert batch.accum_steps == 16 // (2 * dp)
    assert topology.describe_ranks() == ranks
    # Ranks of one sequence- or tensor-parallel group read the same samples: the same data-parallel rank.
    shared = 4 // dp
    assert [topology.data_parallel_rank(r) for r in range(4)] == [r // shared for r in range(4)]
    assert [topology.batch_layout(cfg_train(), r).rank for r in range(4)] == [r // shared for r in range(4)]


def cfg_train():
    return load_config("recipes/tiny.yaml", ["train.global_batch_size=16", "train.micro_batch_size=2"]).train


def test_the_zero_setup_comes_from_the_deepspeed_json_and_autoep_from_the_recipe():
    topology, _, ds_config = launch(2, "distributed.deepspeed_config=zero3_offload")
    assert topology.zero == ZeroSetup.from_ds_config(ds_config) and topology.zero.stage == 3
    assert topology.zero.offload_optimizer and not topology.autoep and topology.expert_group() is None
    topology, _, _ = launch(2, "distributed.deepspeed_config=zero1", "model.arch=qwen3_moe", "model.num_experts=4",
                            "model.experts_per_token=2", "distributed.expert_parallel_size=2")
    assert topology.autoep and topology.expert_parallel_size == 2 and topology.expert_group() == "ep_size_2"
    assert topology.describe_ranks() == "2 processes (AutoEP expert parallel 2: expert groups [0-1])"
    plain, _, ds = launch(2)
    assert ds is None and not plain.zero.deepspeed and plain.describe_state() == "no DeepSpeed"


def test_a_launch_the_splits_do_not_divide_is_refused():
    with pytest.raises(UserError, match="does not divide the world size 3"):
        launch(3, "distributed.deepspeed_config=zero2", "distributed.sequence_parallel_size=2")


def test_the_checkpoint_record_round_trips_and_names_what_changed():
    saved = Topology(4, ZeroSetup(stage=2, offload_optimizer=True, deepspeed=True), sequence_parallel_size=2)
    record = saved.record()
    assert record == {"world_size": 4, "deepspeed": True, "zero_stage": 2, "offload_optimizer": True,
                      "offload_param": False, "sequence_parallel_size": 2, "tensor_parallel_size": 1,
                      "expert_parallel_size": 1}
    assert Topology.from_record(record) == saved
    now = Topology(2, ZeroSetup(stage=3, deepspeed=True))
    assert now.changes_from(saved) == ["processes 4 -> 2", "ZeRO-2 (offload optimizer) -> ZeRO-3",
                                       "sequence parallel 2 -> 1"]
    assert now.needs_conversion_from(saved) and not saved.needs_conversion_from(saved)
    # Without DeepSpeed on either side the state is whole on every rank: any process count loads it.
    assert not Topology(1).needs_conversion_from(Topology(4))


def test_the_start_up_line_is_built_from_the_topology_and_the_batch():
    topology, batch, _ = launch(4, "distributed.deepspeed_config=zero2", "distributed.sequence_parallel_size=2")
    line = startup_line(3_000_000, None, topology, batch, 256, "bf16", 1024)
    assert line == ("model 3.00M params | 2 data-parallel groups of 2 ranks sharing each sequence x micro-batch 2 x "
                    "accumulation 4 = 16 sequences of 256 tokens | precision bf16 | DeepSpeed ZeRO-2 | loss in chunks "
                    "of 1024 tokens")
    assert "(1.50M active per token)" in startup_line(3_000_000, 1_500_000, topology, batch, 256, "bf16", 0)
