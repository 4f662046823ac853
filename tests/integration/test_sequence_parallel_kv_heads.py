"""Sequence parallelism over more ranks than key/value heads (sp=2, one key/value head, which Ulysses replicates)
against one process: losses, gradient norms, validation losses and the checkpoint's probe logits, with document
masking (the attention path that repeats the key/value heads by the module's own count)."""

from __future__ import annotations

import pytest
from helpers import assert_same_run, run_train, write_data

pytestmark = pytest.mark.slow

COMMON = ("train.max_steps=4", "train.eval_every_steps=2", "checkpoint.every_steps=2", "model.num_kv_heads=1",
          "distributed.deepspeed_config=zero1")


def test_fewer_key_value_heads_than_ranks_train_evaluate_and_save_like_one_process(tmp_path):
    from safetensors.torch import load_file

    data = write_data(tmp_path / "data")
    runs = {nproc: tmp_path / f"nproc{nproc}" for nproc in (1, 2)}
    run_train(runs[1], data, list(COMMON))
    run_train(runs[2], data, [*COMMON, "distributed.sequence_parallel_size=2"], nproc=2)
    assert_same_run(runs[2], runs[1], 1e-5)
    probe = [load_file(run / "checkpoints" / "step_00000004" / "probe.safetensors")["logits"] for run in runs.values()]
    assert (probe[0] - probe[1]).abs().max().item() <= 1e-4
