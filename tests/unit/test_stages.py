"""Staged data mixtures: each stage's shares, the order as a pure function of the global sample index, the refusals,
and a tiny in-process run whose resume across a stage boundary is exact."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import ROOT, TINY_OVERRIDES, losses, metric_rows, sources_arg, write_data

from lmrecipe.config import load_config
from lmrecipe.data.order import MixtureOrder, StagedMixtureOrder
from lmrecipe.data.sources import check_sources
from lmrecipe.errors import UserError

TINY = ROOT / "recipes" / "tiny.yaml"
STAGE_WEIGHTS = [[1.0, 0.0, 0.0], [0.5, 0.5, 0.0], [0.2, 0.3, 0.5], [0.0, 0.0, 1.0]]


def test_each_stage_holds_its_shares():
    """Stages of 10,000 samples each: every stage's per-source shares within 1% of its weights."""
    order = StagedMixtureOrder([0, 10_000, 20_000, 30_000], STAGE_WEIGHTS)
    sources, _ = order.assign(np.arange(40_000))
    for k, weights in enumerate(STAGE_WEIGHTS):
        share = np.bincount(sources[k * 10_000:(k + 1) * 10_000], minlength=3) / 10_000
        assert np.abs(share - np.array(weights)).max() <= 0.01, (k, share)
    assert order.stage_of(np.array([0, 9_999, 10_000, 35_000])).tolist() == [0, 0, 1, 3]


def test_the_staged_order_is_a_pure_function_of_the_global_index():
    """Each source's own index counts its earlier samples over all stages: a source that leaves (b in stage 3) and one
    that enters (c in stage 2) go on in their own permutation; any index alone gives the same answer."""
    bounds = [0, 7_001, 12_345, 30_000]
    order = StagedMixtureOrder(bounds, STAGE_WEIGHTS)
    n = 40_000
    sources, counters = order.assign(np.arange(n))
    seen = np.zeros(3, dtype=np.int64)
    replay = np.empty(n, dtype=np.int64)
    for g, k in enumerate(sources):
        replay[g] = seen[k]
        seen[k] += 1
    assert (replay == counters).all() and (order.counts(n) == seen).all()
    for g in (0, 7_000, 7_001, 12_344, 12_345, 29_999, 30_000, 39_999):
        (k,), (counter,) = order.assign(np.array([g]))
        assert (k, counter) == (sources[g], counters[g]) and counter == order.counts(g)[k]
    # Stage 0 alone is the plain mixture of its weights.
    plain_sources, plain_counters = MixtureOrder(STAGE_WEIGHTS[0]).assign(np.arange(bounds[1]))
    assert (plain_sources == sources[:bounds[1]]).all() and (plain_counters == counters[:bounds[1]]).all()


def stage_config(folders, stages: str, *extra):
    return load_config(TINY, [*TINY_OVERRIDES, sources_arg((folders[0], 1, "web"), (folders[1], 1, "code")),
                              f"data.stages={stages}", *extra])


@pytest.mark.parametrize("stages, expected", [
    ("[{start_step: 5, weights: {web: 1}}]", r"data.stages\[0\].start_step=5: the first stage must start at step 0"),
    ("[{start_step: 0, weights: {web: 1}}, {start_step: 0, weights: {code: 1}}]",
     r"data.stages\[1\].start_step=0 is not after data.stages\[0\].start_step=0"),
    ("[{start_step: 0, weights: {web: 1}}, {start_step: 9, weights: {cod: 1}}]",
     r"names the source 'cod', which is not in data.sources \(did you mean 'code'\?\): the sources are web, code"),
    ("[{start_step: 0, weights: {web: 0, code: 0}}]", r"data.stages\[0\].weights are all 0.*positive weight"),
    ("[{start_step: 0, weights: {web: -1, code: 2}}]", r"data.stages\[0\].weights.web=-1 must be a finite number >= 0"),
])
def test_bad_stages_are_refused_with_the_fix(tmp_path, stages, expected):
    with pytest.raises(UserError, match=expected):
        stage_config([tmp_path / "web", tmp_path / "code"], stages)


def test_stages_need_sources():
    with pytest.raises(UserError, match="data.stages needs a mixture: list the folders in data.sources"):
        load_config(TINY, [*TINY_OVERRIDES, "data.stages=[{start_step: 0, weights: {web: 1}}]"])


def test_stages_over_sources_of_different_tokenizers_are_refused(tmp_path):
    folders = [write_data(tmp_path / "web", vocab=1000), write_data(tmp_path / "code", vocab=500, seed=1)]
    cfg = stage_config(folders, "[{start_step: 0, weights: {web: 1}}, {start_step: 9, weights: {code: 1}}]")
    with pytest.raises(UserError, match=r"data.sources\[1\] \(code, .*\) does not share the tokenizer.*re-prepare one"):
        check_sources(cfg.data)


# ---------------------------------------------------------------------------------------------- in-process runs

STAGES = "[{start_step: 0, weights: {code: 1}}, {start_step: 3, weights: {code: 0.25, prose: 0.75}}]"


def train_staged(out, two_sources, *overrides):
    from lmrecipe.train.trainer import train

    return train(load_config(TINY, [
        f"out_dir={out}", *TINY_OVERRIDES, sources_arg((two_sources[0], 1, "code"), (two_sources[1], 1, "prose")),
        f"data.stages={STAGES}", "schedule.decay=constant", "train.eval_every_steps=3", "checkpoint.every_steps=1",
        "checkpoint.keep_last=10", *overrides]))


@pytest.mark.slow
def test_a_resume_across_a_stage_boundary_is_exact(tmp_path, two_sources):
    """Prose enters at step 3 (0-based, the 4th step): 6 steps in one go against 2 steps and a resume; per-source
    tokens follow the stages, the rows name them, and each source keeps its validation loss."""
    train_staged(tmp_path / "whole", two_sources, "train.max_steps=6")
    train_staged(tmp_path / "split", two_sources, "train.max_steps=2")
    train_staged(tmp_path / "split", two_sources, "train.max_steps=6")
    assert losses(tmp_path / "split") == losses(tmp_path / "whole")
    assert metric_rows(tmp_path / "whole", "stage") == {1: 0, 2: 0, 3: 0, 4: 1, 5: 1, 6: 1}
    prose = metric_rows(tmp_path / "whole", "tokens_seen/prose")
    code = metric_rows(tmp_path / "whole", "tokens_seen/code")
    window = 8 * 32  # a step's tokens: 8 sequences of 32
    assert [prose[s] for s in range(1, 7)] == [0, 0, 0, 6 * 32, 12 * 32, 18 * 32]
    assert [code[s] for s in range(1, 7)] == [window, 2 * window, 3 * window, 3 * window + 64, 3 * window + 128,
                                              3 * window + 192]
    assert set(metric_rows(tmp_path / "whole", "val_loss/prose")) == {3, 6}
    assert set(metric_rows(tmp_path / "whole", "val_loss/code")) == {3, 6}
    assert_card_lists_the_stages(tmp_path)
    saved = json.loads((tmp_path / "split" / "checkpoints" / "step_00000002" / "train_state.json").read_text())
    assert saved["data"]["stages"] == [{"start_step": 0, "start_sample": 0, "quotas": [65536, 0]},
                                       {"start_step": 3, "start_sample": 24, "quotas": [16384, 49152]}]


def assert_card_lists_the_stages(runs):
    """The export's model card: the sources with their validation weights, the stages, the one not yet reached."""
    from lmrecipe.export import export_checkpoint

    for run, step, note in (("split", 2, " (not reached: the weights are of step 2)"), ("whole", 6, "")):
        card = (export_checkpoint(runs / run / "checkpoints" / f"step_{step:08d}", runs / f"{run}_export",
                                  dtype="fp32") / "README.md").read_text()
        data = card.split("## Training data\n\n", 1)[1].split("\n## ", 1)[0]
        assert data.startswith("- code (`") and data.count("`), validation weight 1\n") == 2
        assert "- prose (`" in data and ", weight" not in data
        assert "- from step 0: code 1\n" in data and f"- from step 3: code 0.25, prose 0.75{note}\n" in data
