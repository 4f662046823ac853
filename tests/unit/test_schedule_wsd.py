"""Warmup-stable-decay: the rates, the refused settings, and a run lengthened on resume in its stable phase.

Run A (WSD, ``train.max_steps=16``, ``schedule.decay_steps=6``: stable to step 10) and run B (the same with
``train.max_steps=24``) are trained in-process once per session (``build_once``) and shared with test_branch.py.
"""

from __future__ import annotations

import math

import pytest
from helpers import metric_rows, train_wsd, wsd_run

from lmrecipe.config import load_config
from lmrecipe.errors import UserError
from lmrecipe.optim import in_decay, lr_at

LR, MIN_LR = 1e-3, 1e-4


def schedule(*overrides: str):
    cfg = load_config(None, [f"optim.lr={LR}", f"optim.min_lr={MIN_LR}", "schedule.warmup_steps=10", *overrides])
    return cfg


def rates(cfg) -> list[float]:
    return [lr_at(s, cfg.train.max_steps, cfg.optim, cfg.schedule) for s in range(cfg.train.max_steps)]


def reference_rates(max_steps: int, decay: str) -> list[float]:
    """The schedule before warmup-stable-decay existed, written out: warmup 10, then decay to the last step."""
    out = []
    for s in range(max_steps):
        if s < 10:
            out.append(LR * (s + 1) / 10)
        elif decay == "constant":
            out.append(LR)
        else:
            p = min(1.0, (s - 10) / max(1, max_steps - 11))
            shape = 1 - p if decay == "linear" else 0.5 * (1 + math.cos(math.pi * p))
            out.append(MIN_LR + (LR - MIN_LR) * shape)
    return out


@pytest.mark.parametrize("decay", ["cosine", "linear", "constant"])
def test_without_a_decay_length_the_schedule_is_the_earlier_one_exactly(decay):
    cfg = schedule("train.max_steps=111", f"schedule.decay={decay}")
    assert rates(cfg) == reference_rates(111, decay)


@pytest.mark.parametrize("decay,half", [("cosine", 0.5), ("linear", 0.5), ("1-sqrt", 1 - math.sqrt(0.5)),
                                        ("constant", 0.0)])
def test_wsd_holds_the_peak_then_decays_over_the_last_steps_only(decay, half):
    cfg = schedule("train.max_steps=100", "schedule.decay_steps=20", f"schedule.decay={decay}")
    lrs = rates(cfg)
    assert lrs[9] == LR and lrs[10:80] == [LR] * 70  # stable phase: steps 10..79
    assert all(lr < LR for lr in lrs[80:])  # each of the 20 decay steps is below the peak
    assert lrs[89] == pytest.approx(MIN_LR + (LR - MIN_LR) * half)  # half way: progress 10/20
    assert lrs[99] == pytest.approx(MIN_LR, abs=1e-15)  # the last step at min_lr
    assert all(b <= a for a, b in zip(lrs[80:], lrs[81:]))
    assert [in_decay(s, 100, cfg.schedule) for s in (79, 80, 99)] == [False, True, True]


def test_decay_fraction_is_decay_steps_of_the_run_length():
    by_fraction = rates(schedule("train.max_steps=100", "schedule.decay_fraction=0.2", "schedule.decay=1-sqrt"))
    assert by_fraction == rates(schedule("train.max_steps=100", "schedule.decay_steps=20", "schedule.decay=1-sqrt"))


def test_wsd_settings_are_checked():
    with pytest.raises(UserError, match="decay_steps=10 and schedule.decay_fraction=0.1 both set"):
        schedule("train.max_steps=100", "schedule.decay_steps=10", "schedule.decay_fraction=0.1")
    with pytest.raises(UserError, match="does not fit after the warmup"):
        schedule("train.max_steps=100", "schedule.decay_steps=95")
    with pytest.raises(UserError, match=r"decay_fraction=1.5 must be in \(0, 1\]"):
        schedule("schedule.decay_fraction=1.5")
    with pytest.raises(UserError, match="decay_steps=0 must be positive"):
        schedule("schedule.decay_steps=0")


# ---------------------------------------------------------------------------------------------- in-process runs

@pytest.mark.slow
def test_a_run_lengthened_in_its_stable_phase_trains_as_the_longer_run(tmp_path, tmp_path_factory, tiny_data):
    """A (16 steps, decay from step 10) resumed at its step 10 with train.max_steps=24 gives the rates and losses
    of B (24 steps, decay from step 18) at every step after 10: the decay moved, the rate did not jump."""
    a, b = wsd_run(tmp_path_factory, tiny_data, 16), wsd_run(tmp_path_factory, tiny_data, 24)
    longer = train_wsd(tmp_path / "longer", tiny_data, "train.max_steps=24",
                        f"checkpoint.resume={a}/checkpoints/step_00000010")
    for key in ("lr", "loss"):
        got, want = metric_rows(longer, key), metric_rows(b, key)
        assert sorted(got) == list(range(11, 25))
        assert {s: got[s] for s in got} == {s: want[s] for s in got}, key
    assert metric_rows(a, "lr")[11] < metric_rows(longer, "lr")[11] == 2e-3  # A decays from step 11; the longer run
    # holds recipes/tiny.yaml's peak


def test_lengthening_a_run_in_its_decay_is_refused_with_the_fix(tmp_path, tmp_path_factory, tiny_data):
    a = wsd_run(tmp_path_factory, tiny_data, 16)
    with pytest.raises(UserError, match=r"trained 5 step\(s\) of the decay .*\(train.max_steps=16\) to finish the "
                                        r"decay, or branch a new run"):
        train_wsd(tmp_path / "late", tiny_data, "train.max_steps=24", f"checkpoint.resume={a}/checkpoints/step_00000015")
    assert not (tmp_path / "late" / "checkpoints").exists()
