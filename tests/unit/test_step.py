"""The training step as an accelerator sees it: no host syncs between sync points, prefetched input, compile."""

from __future__ import annotations

import pytest
import torch
from helpers import TINY_OVERRIDES

from lmrecipe.config import load_config
from lmrecipe.data.batches import BatchLayout, Prefetcher, TrainBatches
from lmrecipe.data.format import TokenWindows
from lmrecipe.observe.host_syncs import HostSyncCounter
from lmrecipe.parallel.accelerator import release_distributed


def count_syncs(tiny_data, out_dir, max_steps: int, overrides: tuple[str, ...] = ()) -> HostSyncCounter:
    """Host syncs of a whole in-process ``train()`` whose only sync points are step 1 and the last step."""
    from lmrecipe.train.trainer import train

    cfg = load_config("recipes/tiny.yaml", [
        f"out_dir={out_dir}", f"data.path={tiny_data}", *TINY_OVERRIDES, f"train.max_steps={max_steps}",
        "logging.log_every_steps=1000", "train.eval_every_steps=0", "checkpoint.every_steps=0", "checkpoint.resume=none",
        *overrides,
    ])
    with HostSyncCounter() as counter:
        train(cfg)
    return counter


@pytest.mark.parametrize("overrides", [(), ("train.ema_decay=0.99",), ("logging.layer_stats=true", "train.z_loss=1e-4")],
                         ids=["plain", "weight_ema", "layer_stats_and_z_loss"])
def test_unlogged_steps_make_no_host_sync(tmp_path, tiny_data, overrides):
    """Two runs with the same sync points (step 1, the last) differ only by 8 unlogged steps: their counts must match."""
    short = count_syncs(tiny_data, tmp_path / "short", 3, overrides)
    long = count_syncs(tiny_data, tmp_path / "long", 11, overrides)
    assert short.total > 0  # the counter sees the logged steps' reads, evaluation and checkpoint
    per_step = (long.total - short.total) / 8
    assert per_step == 0, f"{per_step} host syncs per unlogged step: short {short.calls}, long {long.calls}"


def test_counter_sees_the_syncs_a_gpu_would_pay():
    t = torch.ones(3)
    with HostSyncCounter() as counter:
        t.sum().item()
        float(t.sum())
        if t.sum() > 0:
            pass
        t + 1  # no read: not counted
    assert counter.calls == {"item": 1, "__float__": 1, "__bool__": 1}


def test_prefetcher_gives_the_loader_order(tiny_data):
    windows = TokenWindows(tiny_data, "train", 16)
    batches = TrainBatches(windows, BatchLayout(8, 2, 2, 1), seed=3)
    prefetcher = Prefetcher(batches)
    try:
        for step in [0, 1, 2, 7, 8, 3]:  # in order, then jumps (a resume) both ways
            got = prefetcher.get(step)
            want = list(batches.micro_batches(step))
            assert len(got) == len(want) == 2
            for (gi, gt, _), (wi, wt, _) in zip(got, want):
                assert torch.equal(gi, wi) and torch.equal(gt, wt)
    finally:
        prefetcher.close()



def test_fused_adamw_under_deepspeed_trains_as_foreach(tmp_path, tiny_data, monkeypatch, deepspeed_in_process):
    """ZeRO-2 on one process: the fused AdamW the run builds moves the weights as foreach's per-operation kernels do,
    within 1e-6 after 4 steps."""
    from lmrecipe.train import setup
    from lmrecipe.train.trainer import build_trainer

    def train_zero2(name: str) -> tuple[object, dict, dict]:
        release_distributed()  # each run builds its own process group and Accelerate state
        cfg = load_config("recipes/tiny.yaml", [
            f"out_dir={tmp_path / name}", f"data.path={tiny_data}", *TINY_OVERRIDES, "train.max_steps=4",
            "train.eval_every_steps=0", "checkpoint.every_steps=0", "distributed.deepspeed_config=zero2"])
        run = setup.build_run(cfg, tmp_path / name)
        adamw = run.optimizer.optimizer.optimizer  # Accelerate's wrapper -> DeepSpeed's ZeRO optimizer -> AdamW
        before = {n: p.detach().float().clone() for n, p in run.model.module.named_parameters()}
        trainer = build_trainer(run, tmp_path / name)
        trainer.start()
        try:
            for _ in range(4):
                trainer.step()
        finally:
            trainer.close()
        after = {n: p.detach().float().clone() for n, p in run.model.module.named_parameters()}
        return adamw.defaults.get("fused"), before, after

    fused_flag, before, fused = train_zero2("fused")
    original = setup.build_optimizer
    monkeypatch.setattr(setup, "build_optimizer", lambda *args, **kwargs: original(*args, **{**kwargs, "fused": False}))
    foreach_flag, _, foreach = train_zero2("foreach")
    assert fused_flag is True and not foreach_flag
    assert max((fused[n] - before[n]).abs().max().item() for n in fused) > 1e-4  # trained weights are compared
    assert max((fused[n] - foreach[n]).abs().max().item() for n in fused) <= 1e-6
