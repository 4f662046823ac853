"""The straggler detector's rule (margin, logged steps in a row, the warm-up row, a rollback), the host clock, and
the figures a 1-process run writes (in-process)."""

from __future__ import annotations

import time

import pytest
import torch
from helpers import TINY_OVERRIDES

from lmrecipe.config import load_config
from lmrecipe.observe.metrics_log import read_metrics
from lmrecipe.observe.stragglers import ComputeClock, StragglerDetector, rank_vector

HOSTS = ["node-a", "node-a", "node-b", "node-b"]


def test_a_rank_slower_than_the_median_by_the_margin_at_3_rows_in_a_row_is_named_once(caplog):
    detector = StragglerDetector(margin=0.2, logged_steps=3, hosts=HOSTS)
    slow = [1.0, 1.0, 1.3, 1.0]
    rows = [detector.observe(step, slow) for step in (1, 2, 3, 4, 5)]
    assert [r["stragglers"] for r in rows[:3]] == [[], [], []]  # the warm-up row, then 2 slow rows
    assert rows[3]["stragglers"] == rows[4]["stragglers"] == [{"rank": 2, "host": "node-b", "ratio": 1.3}]
    assert rows[4]["compute_slowest_rank"] == 2 and rows[4]["compute_s_median"] == 1.0
    assert [r.getMessage()[:32] for r in caplog.records] == ["Straggler: rank 2 on node-b comp"]


def test_within_the_margin_or_not_in_a_row_names_none():
    detector = StragglerDetector(margin=0.2, logged_steps=3, hosts=HOSTS)
    for step, slowest in enumerate([1.19, 1.5, 1.5, 1.0, 1.5, 1.5, 1.19, 1.5]):
        assert detector.observe(step, [1.0, 1.0, slowest, 1.0])["stragglers"] == []


def test_a_rollback_restarts_the_count():
    detector = StragglerDetector(margin=0.2, logged_steps=2, hosts=HOSTS)
    detector.observe(1, [1.0, 1.0, 1.0, 1.0])
    detector.observe(2, [2.0, 1.0, 1.0, 1.0])
    detector.reset()
    assert detector.observe(3, [2.0, 1.0, 1.0, 1.0])["stragglers"] == []
    assert detector.observe(4, [2.0, 1.0, 1.0, 1.0])["stragglers"][0]["rank"] == 0


def test_the_host_clock_sums_the_timed_sections_until_read():
    clock = ComputeClock(torch.device("cpu"))
    for _ in range(2):
        clock.start()
        time.sleep(0.02)
        clock.stop()
    time.sleep(0.05)  # not timed
    assert 0.04 <= clock.take_s() < 0.09
    assert clock.take_s() == 0.0
    assert rank_vector(2.5, 1, 3).tolist() == [0.0, 2.5, 0.0]


def test_a_run_writes_the_compute_figures_and_names_nobody(tmp_path, tiny_data):
    from lmrecipe.train.trainer import train

    cfg = load_config("recipes/tiny.yaml", [f"out_dir={tmp_path}", f"data.path={tiny_data}", *TINY_OVERRIDES,
                                            "train.max_steps=4", "train.eval_every_steps=0",
                                            "checkpoint.every_steps=0"])
    train(cfg)
    rows = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "loss" in r]
    assert len(rows) == 4 and all(r["stragglers"] == [] and r["compute_slowest_rank"] == 0 for r in rows)
    # one micro-batch of 4 x 32 tokens: its forward is part of the step
    assert all(0 < r["compute_s_median"] == r["compute_s_max"] < r["step_time_s"] for r in rows)


def test_off_the_rows_carry_no_compute_figures(tmp_path, tiny_data):
    from lmrecipe.train.trainer import train

    cfg = load_config("recipes/tiny.yaml", [f"out_dir={tmp_path}", f"data.path={tiny_data}", *TINY_OVERRIDES,
                                            "train.max_steps=2", "train.eval_every_steps=0",
                                            "checkpoint.every_steps=0", "distributed.stragglers=false"])
    train(cfg)
    assert not any("compute_s_median" in r for r in read_metrics(tmp_path / "metrics.jsonl"))


@pytest.mark.parametrize("key", ["distributed.straggler_margin=0", "distributed.straggler_logged_steps=0"])
def test_a_margin_or_count_that_is_not_positive_is_refused(key):
    from lmrecipe.errors import UserError

    with pytest.raises(UserError, match=key.split("=")[0].split(".")[1]):
        load_config("recipes/tiny.yaml", [key])


def test_the_doctor_names_each_straggler_with_its_host_and_steps():
    from lmrecipe.observe.doctor import diagnose

    named = [{"rank": 3, "host": "node-b", "ratio": 1.4}]
    rows = [{"step": s, "loss": 2.0, "stragglers": named if s >= 30 else []} for s in range(10, 60, 10)]
    [finding] = [f for f in diagnose(rows, {}) if f.name == "straggler"]
    assert finding.evidence == "rank 3 on node-b: up to 1.40x the median rank's forward time (steps 30-50)"
    assert "--exclude=node-b" in finding.fix
    assert not [f for f in diagnose([{**r, "stragglers": []} for r in rows], {}) if f.name == "straggler"]
