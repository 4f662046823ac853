"""Loss spikes: the rule on the device, the skipped-batch order, and real runs that roll back, skip and resume.

A spike is injected with ``LMRECIPE_FAULT_SPIKE_STEPS=N``: the model's logits are multiplied by 1000 whenever its
input is a micro-batch of step N's samples (in the order without skips), so the fault follows the samples, as bad
data does. Its log line says each time it fires: a sample trained on again after the rollback would show.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from helpers import TINY_OVERRIDES

from lmrecipe.config import SpikeConfig, load_config
from lmrecipe.data.batches import BatchLayout, MixtureBatches, TrainBatches
from lmrecipe.data.format import TokenWindows
from lmrecipe.data.order import MixtureOrder, SampleOrder, data_step
from lmrecipe.errors import UserError
from lmrecipe.observe.host_syncs import HostSyncCounter
from lmrecipe.train.callbacks.spikes import SpikeDetector

# ---------------------------------------------------------------------------------------------- unit


def test_data_step_replaces_skipped_blocks_by_the_next_unused_ones():
    assert [data_step(s) for s in range(5)] == [0, 1, 2, 3, 4]
    assert [data_step(s, [2]) for s in range(5)] == [0, 1, 3, 4, 5]
    assert [data_step(s, [2, 3, 7]) for s in range(7)] == [0, 1, 4, 5, 6, 8, 9]
    assert [data_step(s, [0]) for s in range(3)] == [1, 2, 3]


def test_batches_follow_the_skipped_list(tiny_data):
    windows = TokenWindows(tiny_data, "train", 16)
    layout = BatchLayout(global_batch_size=8, micro_batch_size=2, world_size=2, rank=1)
    batches = TrainBatches(windows, layout, seed=5)
    before = {s: [batches.window_ids(s, m) for m in range(layout.accum_steps)] for s in range(6)}
    batches.skipped = (2, 3)
    after = {s: [batches.window_ids(s, m) for m in range(layout.accum_steps)] for s in range(4)}
    for s, d in [(0, 0), (1, 1), (2, 4), (3, 5)]:
        assert all(np.array_equal(a, b) for a, b in zip(after[s], before[d]))
    # the spike log lists every rank's windows of a data step, in global sample order
    assert batches.data_step_samples(4) == SampleOrder(len(windows), 5).windows(32, 8).tolist()


def test_mixture_accounting_leaves_skipped_blocks_out(tiny_data):
    windows = TokenWindows(tiny_data, "train", 16)
    layout = BatchLayout(global_batch_size=8, micro_batch_size=4, world_size=1, rank=0)
    batches = MixtureBatches([windows, windows], ["a", "b"], [0.7, 0.3], layout, seed=1)
    batches.skipped = (1, 4)
    order = MixtureOrder([0.7, 0.3])
    trained = [data_step(s, batches.skipped) for s in range(6)]
    expected = sum(np.bincount(order.assign(np.arange(d * 8, d * 8 + 8))[0], minlength=2) for d in trained)
    assert batches.samples_seen(6).tolist() == expected.tolist()
    assert [name for name, _ in batches.data_step_samples(4)] == [["a", "b"][k] for k in order.assign(np.arange(32, 40))[0]]


def test_spike_settings_are_checked():
    with pytest.raises(UserError, match=r"spike.min_history=200 exceeds spike.window=100"):
        load_config("recipes/tiny.yaml", ["spike.min_history=200"])
    with pytest.raises(UserError, match=r"spike.z_threshold=0.0 must be positive"):
        load_config("recipes/tiny.yaml", ["spike.z_threshold=0"])
    assert load_config("recipes/tiny.yaml", []).spike.enabled is False  # off by default


def detector(**overrides) -> SpikeDetector:
    section = SpikeConfig(enabled=True, window=8, min_history=4, z_threshold=6.0, **overrides)
    return SpikeDetector(section, torch.device("cpu"))


def feed(det: SpikeDetector, losses, norms=None) -> None:
    for i, loss in enumerate(losses):
        det.observe(i + 1, torch.tensor(loss), torch.tensor(1.0 if norms is None else norms[i]))


def test_detector_flags_a_spike_but_not_a_falling_or_noisy_curve():
    det = detector()
    rng = np.random.default_rng(0)
    falling = list(6.0 - 0.1 * np.arange(30) + rng.normal(0, 0.05, 30))
    feed(det, falling)
    flagged, window = det.collect()
    assert flagged == [] and len(window) == 8
    det.observe(31, torch.tensor(9.0), torch.tensor(1.0))
    det.observe(32, torch.tensor(falling[-1]), torch.tensor(1.0))
    flagged, window = det.collect()
    assert [f["step"] for f in flagged] == [31] and flagged[0]["reason"] == "z-score above the threshold"
    assert flagged[0]["loss_z"] > 6 and math.isclose(flagged[0]["loss"], 9.0)
    assert math.isclose(flagged[0]["window_loss_mean"], float(np.mean(falling[-8:])), rel_tol=1e-5)
    assert 9.0 not in [row[0] for row in window]  # a flagged step never enters the window


def test_detector_needs_history_but_not_for_non_finite_values():
    det = detector()
    feed(det, [5.0, 50.0])  # a jump before min_history steps: not judged
    assert det.collect()[0] == []
    feed(det, [5.0, float("nan"), 5.0], norms=[1.0, 1.0, float("inf")])
    assert [f["reason"] for f in det.collect()[0]] == ["loss not finite", "gradient norm not finite"]
    fp16 = SpikeDetector(SpikeConfig(enabled=True, window=8, min_history=4), torch.device("cpu"),
                         grad_norm_must_be_finite=False)
    feed(fp16, [5.0, 5.0], norms=[1.0, float("inf")])  # a GradScaler overflow: routine under fp16
    assert fp16.collect()[0] == []


def test_detector_grad_norm_rule_and_window_round_trip():
    det = detector(grad_norm_z_threshold=6.0)
    feed(det, [5.0] * 6, norms=[1.0, 1.1, 0.9, 1.0, 1.05, 0.95])
    det.observe(7, torch.tensor(5.0), torch.tensor(40.0))
    flagged, window = det.collect()
    assert [f["step"] for f in flagged] == [7]
    again = detector(grad_norm_z_threshold=6.0)
    again.load(json.loads(json.dumps(window)))  # as saved in train_state.json
    assert torch.equal(torch.nan_to_num(again.buffer, -1.0), torch.nan_to_num(det.buffer, -1.0))


def test_detection_and_background_saves_add_no_host_sync_per_unlogged_step(tmp_path, tiny_data):
    from lmrecipe.train.trainer import train

    def syncs(max_steps: int) -> HostSyncCounter:
        cfg = load_config("recipes/tiny.yaml", [
            f"out_dir={tmp_path / str(max_steps)}", f"data.path={tiny_data}", *TINY_OVERRIDES,
            f"train.max_steps={max_steps}", "logging.log_every_steps=1000", "train.eval_every_steps=0",
            "checkpoint.every_steps=0", "checkpoint.resume=none", "spike.enabled=true", "spike.window=4",
            "spike.min_history=2", "checkpoint.background_save=true",
        ])
        with HostSyncCounter() as counter:
            train(cfg)
        return counter

    short, long = syncs(3), syncs(11)
    assert (long.total - short.total) / 8 == 0, f"short {short.calls}, long {long.calls}"
