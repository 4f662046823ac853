"""The batch-size ramp: each step's consecutive sample range, its refusals, the learning rate it scales, and tiny
in-process runs whose resume inside the ramp is exact (also under DeepSpeed ZeRO-1 on one process)."""

from __future__ import annotations

import json
import logging
import math
from types import SimpleNamespace

import numpy as np
import pytest
from helpers import ROOT, TINY_OVERRIDES, losses, metric_rows, write_data

from lmrecipe.config import check_rules, load_config
from lmrecipe.data.batches import BatchLayout, BatchRamp, StepBatches
from lmrecipe.errors import UserError
from lmrecipe.train.setup import Run

TINY = ROOT / "recipes" / "tiny.yaml"
RAMP = "train.batch_ramp=[{step: 0, size: 4}, {step: 2, size: 8}, {step: 4, size: 16}]"


class SampleIds(StepBatches):
    """The order as the identity: a micro-batch's "windows" are its global sample indices."""

    def locate(self, samples):
        return np.zeros(len(samples), dtype=np.int64), np.asarray(samples)


def step_samples(ramp: BatchRamp, step: int, world_size: int, micro: int, skipped=()) -> list[int]:
    """Every sample optimizer step ``step`` reads, over all ranks and micro-steps."""
    out = []
    for rank in range(world_size):
        batches = SampleIds([], BatchLayout(int(ramp.sizes[-1]), micro, world_size, rank))
        batches.ramp, batches.skipped = ramp, tuple(skipped)
        position = batches.data_position(step)
        out += [int(i) for m in range(batches.accum_steps(position)) for i in batches.data_window_ids(position, m)]
    return out


@pytest.mark.parametrize("world_size, micro", [(1, 4), (2, 2), (4, 1)])
def test_a_whole_ramp_reads_every_sample_once_in_order(world_size, micro):
    cfg = load_config(TINY, ["train.global_batch_size=64", "train.batch_ramp_start_size=8", "train.batch_ramp_increment=8",
                             "train.batch_ramp_steps_per_increment=3"])
    ramp = BatchRamp(cfg.train.ramp_points())
    sizes = [ramp.size(s) for s in range(30)]
    assert sizes[:7] == [8, 8, 8, 16, 16, 16, 24] and sizes[21:] == [64] * 9
    read = []
    for step in range(30):
        samples = step_samples(ramp, step, world_size, micro)
        first, end = ramp.range(step)
        assert sorted(samples) == list(range(first, end))  # step s takes [start(s), start(s) + size(s))
        read += sorted(samples)
    assert read == list(range(ramp.start(30)))  # none skipped, none repeated, in the order's order
    assert ramp.start(30) == sum(sizes)


def test_skipped_data_steps_are_the_ramps_ranges():
    ramp = BatchRamp([(0, 4), (2, 8), (4, 16)])
    # Data step 2 (samples [8, 16)) skipped: step 2 reads data step 3's range, the next unused samples.
    assert sorted(step_samples(ramp, 2, 2, 2, skipped=[2])) == list(range(16, 24))
    batches = SampleIds([], BatchLayout(16, 2, 2, 0))
    batches.ramp, batches.skipped = ramp, (2,)
    assert [batches.step_size(s) for s in range(4)] == [4, 4, 8, 16]
    assert [batches.next_sample(s) for s in range(5)] == [0, 4, 16, 24, 40]
    assert batches.data_step_samples(2) == list(range(8, 16))  # the spike log's samples of the skipped range


def test_a_ramp_free_run_keeps_blocks_of_the_global_batch():
    ramp = BatchRamp(load_config(TINY, ["train.global_batch_size=24"]).train.ramp_points())
    assert ramp.is_constant and [ramp.range(s) for s in (0, 5)] == [(0, 24), (120, 144)]


@pytest.mark.parametrize("overrides, expected", [
    (["train.batch_ramp=[{step: 1, size: 8}, {step: 3, size: 16}]"], r"train.batch_ramp\[0\].step=1: the ramp must start"),
    (["train.batch_ramp=[{step: 0, size: 8}, {step: 0, size: 16}]"], r"batch_ramp\[1\].step=0 is not after"),
    (["train.batch_ramp=[{step: 0, size: 8}, {step: 3, size: 12}]"], r"ends at size 12, not at train.global_batch_size=16"),
    (["train.batch_ramp=[{step: 0, size: 32}, {step: 3, size: 16}]"], r"batch_ramp\[0\].size=32 must be in \[1, "),
    ([RAMP, "train.batch_ramp_start_size=4", "train.batch_ramp_increment=4", "train.batch_ramp_steps_per_increment=1"],
     "both set"),
    (["train.batch_ramp_start_size=4"], "needs train.batch_ramp_increment and train.batch_ramp_steps_per_increment"),
    (["train.batch_ramp=[{step: 0, size: 6}, {step: 3, size: 16}]"],
     r"step sizes \(6\) that are not multiples of train.micro_batch_size=4.*Choose sizes that are multiples of 4"),
])
def test_a_bad_ramp_is_refused_with_the_fix(overrides, expected):
    with pytest.raises(UserError, match=expected):
        check_rules(load_config(TINY, [*TINY_OVERRIDES, "train.global_batch_size=16", *overrides]))


def test_ramp_sizes_must_split_over_the_processes():
    cfg = load_config(TINY, [*TINY_OVERRIDES, "train.global_batch_size=16", RAMP])
    BatchRamp.from_config(cfg.train, BatchLayout(16, 4, 1, 0))
    with pytest.raises(UserError, match=r"\(4\) that are not multiples of train.micro_batch_size=4 x 2 data-parallel "
                                        r"processes = 8.*multiples of 8"):
        BatchRamp.from_config(cfg.train, BatchLayout(16, 4, 2, 0))


def test_sqrt_scaling_follows_the_step_size():
    cfg = load_config(TINY, [*TINY_OVERRIDES, "train.global_batch_size=16", RAMP, "schedule.decay=constant",
                             "schedule.warmup_steps=0", "train.batch_ramp_lr_scaling=sqrt", "optim.lr=1e-3"])
    batches = SampleIds([], BatchLayout(16, 4, 1, 0))
    batches.ramp = BatchRamp(cfg.train.ramp_points())
    run = SimpleNamespace(cfg=cfg, train_batches=batches)
    assert [Run.lr_at(run, s) for s in (0, 2, 4, 9)] == pytest.approx([5e-4, 1e-3 * math.sqrt(0.5), 1e-3, 1e-3])
    cfg.train.batch_ramp_lr_scaling = "none"
    assert Run.lr_at(run, 0) == pytest.approx(1e-3)


# ---------------------------------------------------------------------------------------------- in-process runs


def train_tiny(out, data, *overrides):
    """One in-process run of the tiny model on a ramp, from a fresh Accelerate state (Accelerate keeps one per
    process, and a DeepSpeed run needs its own)."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        return _train(out, data, *overrides)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def _train(out, data, *overrides):
    from lmrecipe.train.trainer import train

    return train(load_config(TINY, [f"out_dir={out}", f"data.path={data}", *TINY_OVERRIDES, "train.global_batch_size=16",
                                    RAMP, "train.batch_ramp_lr_scaling=sqrt", "schedule.decay=constant",
                                    "train.eval_every_steps=0", "checkpoint.every_steps=1", "checkpoint.keep_last=10",
                                    *overrides]))


@pytest.fixture(scope="module")
def ramp_run(tmp_path_factory):
    """6 steps of sizes 4, 4, 8, 8, 16, 16 (accumulation 1, 1, 2, 2, 4, 4) in one go, plain PyTorch: the data and the
    run folder."""
    root = tmp_path_factory.mktemp("ramp")
    data = write_data(root / "data")
    state = train_tiny(root / "whole", data, "train.max_steps=6")
    return SimpleNamespace(data=data, out=root / "whole", state=state)


def test_a_resume_inside_the_ramp_is_exact(tmp_path, ramp_run, caplog):
    """3 steps and a resume at step 3 (inside the ramp) against the run in one go: the same losses; tokens,
    throughput and the data position follow the sizes. The 3-step session warns at start-up that the ramp's last
    point (step 4) is past its end; the 6-step one reaches it and says nothing."""
    with caplog.at_level(logging.WARNING):
        train_tiny(tmp_path / "split", ramp_run.data, "train.max_steps=3")
    assert ("train.batch_ramp[2] (step 4, size 16) starts at or after train.max_steps=3 (the last optimizer step is "
            "2), so it never takes effect: the run ends at 8 sequences per step") in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        train_tiny(tmp_path / "split", ramp_run.data, "train.max_steps=6")
    assert "train.batch_ramp[" not in caplog.text
    assert losses(tmp_path / "split") == losses(ramp_run.out)
    assert ramp_run.state.tokens_seen == (4 + 4 + 8 + 8 + 16 + 16) * 32
    assert metric_rows(ramp_run.out, "tokens_seen") == {1: 128, 2: 256, 3: 512, 4: 768, 5: 1280, 6: 1792}
    rows = [r for r in map(json.loads, (ramp_run.out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert [r["tokens_per_sec"] * r["interval_time_s"] for r in rows] == pytest.approx([s * 32 for s in (4, 4, 8, 8, 16, 16)])
    saved = json.loads((tmp_path / "split" / "checkpoints" / "step_00000003" / "train_state.json").read_text())
    assert saved["data"]["next_sample"] == 16 and saved["state"]["tokens_seen"] == 512
    assert metric_rows(ramp_run.out, "lr")[1] == pytest.approx(metric_rows(ramp_run.out, "lr")[2] / 2)  # warmup x sqrt(4/16)


@pytest.mark.slow
def test_the_ramp_under_deepspeed_matches_the_plain_run(tmp_path, ramp_run, deepspeed_in_process):
    """ZeRO-1 on one process: the engine's accumulation changes with the Accelerator's at every size change (1, 2,
    then 4 micro-steps), and every loss matches the plain run's. (One DeepSpeed run per process: a second one in the
    same process trips over DeepSpeed's cached process groups; tests/integration/test_batch_ramp.py runs 2 processes.)"""
    train_tiny(tmp_path / "zero1", ramp_run.data, "train.max_steps=6", "distributed.deepspeed_config=zero1")
    plain, ds = dict(losses(ramp_run.out)), dict(losses(tmp_path / "zero1"))
    assert sorted(ds) == list(range(1, 7))
    assert max(abs(ds[s] - plain[s]) for s in plain) <= 1e-6


def test_the_planner_counts_the_ramps_tokens():
    from lmrecipe.parallel.topology import Topology
    from lmrecipe.model.build import build_hf_config
    from lmrecipe.planning.prediction import predict_run

    cfg = load_config(TINY, ["train.global_batch_size=16", "train.micro_batch_size=4", "train.max_steps=10", RAMP])
    hf = build_hf_config(cfg.model, 8192, cfg.data.seq_len)
    out = predict_run(cfg.workload(), hf, topology=Topology(1), precision="fp32", accum_steps=1,
                      flops_per_token=1e7, peak_tflops=0.08, device_name=None)
    assert out["run_tokens"] == (4 + 4 + 8 + 8 + 6 * 16) * cfg.data.seq_len
    assert out["run_time_s"] == pytest.approx(out["run_tokens"] / out["tokens_per_sec"])
    assert out["step_time_s"] == pytest.approx(16 * cfg.data.seq_len / out["tokens_per_sec"])
