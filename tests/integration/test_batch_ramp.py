"""A batch-size ramp on 2 processes under DeepSpeed ZeRO-1 trains as the same ramp on one process does."""

from __future__ import annotations

import pytest
from helpers import losses, run_train, write_data

pytestmark = pytest.mark.slow

RAMP = ["train.global_batch_size=16", "train.micro_batch_size=2", "train.max_steps=6", "schedule.decay=constant",
        "train.batch_ramp=[{step: 0, size: 4}, {step: 2, size: 8}, {step: 4, size: 16}]",
        "train.batch_ramp_lr_scaling=sqrt", "train.eval_every_steps=0", "checkpoint.every_steps=0"]


def test_a_ramp_on_two_zero1_processes_matches_one_process(tmp_path):
    """Sizes 4, 8, 16: accumulation 1, 2, 4 on each of 2 ranks (2, 4, 8 on one process); every loss within 1e-6."""
    data = write_data(tmp_path / "data")
    run_train(tmp_path / "one", data, RAMP)
    run_train(tmp_path / "zero1", data, [*RAMP, "distributed.deepspeed_config=zero1"], nproc=2)
    one, two = dict(losses(tmp_path / "one")), dict(losses(tmp_path / "zero1"))
    assert sorted(two) == list(range(1, 7))
    assert max(abs(two[s] - one[s]) for s in one) <= 1e-6, (one, two)
