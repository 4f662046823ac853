"""Weighted data mixtures: config records, the order as a pure function of the global sample index, realised
proportions, per-source metrics end to end, exact resume, and bad input stopping before anything is written."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import ROOT, SEQ_LEN, sources_arg, write_data

from lmrecipe.config import DataConfig, DataSource, config_from_dict, load_config
from lmrecipe.data.batches import BatchLayout, MixtureBatches, TrainBatches
from lmrecipe.data.format import TokenWindows
from lmrecipe.data.order import MIX_BLOCK, MixtureOrder
from lmrecipe.data.sources import check_sources, open_training_data
from lmrecipe.errors import UserError

# ---------------------------------------------------------------------------------------------- config


def test_sources_from_a_recipe_and_from_the_command_line(tmp_path):
    recipe = tmp_path / "mix.yaml"
    recipe.write_text("data:\n  sources:\n    - {path: data/code, weight: 0.7, name: code}\n"
                      "    - {path: data/prose, weight: 0.3}\n  seq_len: 64\n")
    cfg = load_config(recipe)
    assert cfg.data.path is None  # the recipe's layer chose the mixture over the default folder
    assert cfg.data.sources == [DataSource("data/code", 0.7, "code"), DataSource("data/prose", 0.3)]
    assert [s.resolved_name() for s in cfg.data.sources] == ["code", "prose"]
    assert config_from_dict(cfg.to_dict()) == cfg  # what config.yaml and checkpoints hold reloads the same
    # A command-line mixture replaces the recipe's data.path, and a command-line data.path replaces a mixture.
    cfg = load_config(ROOT / "recipes/tiny.yaml", ["data.sources=[{path: a, weight: 2}, {path: b, weight: 1, name: bee}]"])
    assert cfg.data.path is None and [(s.path, s.weight, s.resolved_name()) for s in cfg.data.sources] == [
        ("a", 2.0, "a"), ("b", 1.0, "bee")]
    cfg = load_config(recipe, ["data.path=data/stdlib"])
    assert cfg.data.path == "data/stdlib" and cfg.data.sources == []
    assert load_config(ROOT / "recipes/tiny.yaml").data.source_list() == [DataSource("data/stdlib")]


@pytest.mark.parametrize("overrides, expected", [
    (["data.sources=[{path: a, wieght: 1}]"], "Unknown config key data.sources[0].wieght. Did you mean data.sources[0].weight?"),
    (["data.sources=[{path: a, weight: heavy}]"], "data.sources[0].weight='heavy' must be a number"),
    (["data.sources=[{weight: 1}]"], "data.sources[0] lacks path"),
    (["data.sources={path: a}"], "must be a list"),
    (["data.sources=[a, b]"], "data.sources[0]='a' must be a mapping with keys path, weight, name"),
    (["data.sources=[{path: a, weight: -0.5}, {path: b}]"], "data.sources[0].weight=-0.5 (a) must be a finite number >= 0"),
    (["data.sources=[{path: a, weight: 0}, {path: b, weight: 0}]"], "The weights of data.sources sum to zero"),
    (["data.sources=[{path: x/code}, {path: y/code}]"], "data.sources[0] and data.sources[1] are both named 'code'"),
    (["data.sources=[{path: a}]", "data.path=b"], "The command line sets both data.path and data.sources"),
    (["data.path=null"], "No training data: set data.path"),
])
def test_bad_sources_name_the_key(overrides, expected):
    with pytest.raises(UserError) as err:
        load_config(ROOT / "recipes/tiny.yaml", overrides)
    assert expected in str(err.value)


def test_both_in_one_recipe_is_an_error(tmp_path):
    recipe = tmp_path / "both.yaml"
    recipe.write_text("data:\n  path: data/stdlib\n  sources: [{path: data/code}]\n")
    with pytest.raises(UserError, match="sets both data.path and data.sources"):
        load_config(recipe)


# ---------------------------------------------------------------------------------------------- order


@pytest.fixture
def two_folders(tmp_path) -> list[Path]:
    # Different sizes, so the two sources wrap into new epochs at different global indices.
    return [write_data(tmp_path / "a", n_train=4001, seed=0), write_data(tmp_path / "b", n_train=1601, seed=1)]


def mixture(folders, layout: BatchLayout, weights=(0.7, 0.3), seed=11) -> MixtureBatches:
    windows = [TokenWindows(f, "train", SEQ_LEN) for f in folders]
    return MixtureBatches(windows, [f.name for f in folders], list(weights), layout, seed)


def step_samples(batches: MixtureBatches, step: int) -> list[tuple[int, int]]:
    return [tuple(int(v) for v in row) for m in range(batches.layout.accum_steps) for row in batches.window_ids(step, m)]


@pytest.mark.parametrize("world_size, micro", [(1, 4), (2, 4), (3, 8), (4, 2), (6, 1)])
def test_step_contents_do_not_depend_on_the_split(two_folders, world_size, micro):
    reference = mixture(two_folders, BatchLayout(24, 24, 1, 0))
    for step in (0, 1, 9, 40, 120):  # source b (100 windows) is past its 10th epoch by step 120
        expected = Counter(step_samples(reference, step))
        got = Counter()
        for rank in range(world_size):
            got.update(step_samples(mixture(two_folders, BatchLayout(24, micro, world_size, rank)), step))
        assert got == expected


def test_resume_needs_no_skipping_and_reads_the_right_rows(two_folders):
    a = mixture(two_folders, BatchLayout(8, 4, 1, 0))
    b = mixture(two_folders, BatchLayout(8, 4, 1, 0))
    windows = [TokenWindows(f, "train", SEQ_LEN) for f in two_folders]
    for (xa, ya, _), (xb, yb, _), ids in zip(a.micro_batches(17), b.micro_batches(17), (a.window_ids(17, m) for m in range(2))):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
        for row, (k, w) in zip(xa, ids):
            assert torch.equal(row, windows[k].batch([w])[0][0])
    # Sources are drawn from, and each source's own permutation differs from the other's.
    assert {k for m in range(2) for k, _ in a.window_ids(17, m)} == {0, 1}


def test_per_source_index_is_a_pure_function_of_the_global_index():
    order = MixtureOrder([0.5, 0.3, 0.2])
    n = 2 * MIX_BLOCK + 5000
    sources, counters = order.assign(np.arange(n))
    seen = np.zeros(3, dtype=np.int64)  # replay the history: the per-source counter is the number of earlier picks
    replay = np.empty(n, dtype=np.int64)
    for g, k in enumerate(sources):
        replay[g] = seen[k]
        seen[k] += 1
    assert (replay == counters).all()
    assert (order.counts(n) == seen).all()
    # Any index alone, in constant time: its source's counter is the number of that source's samples before it.
    for g in (7, 70_000, 131_071, 131_072, 3_000_000_001):
        (k,), (counter,) = order.assign(np.array([g]))
        assert counter == order.counts(g)[k] and order.counts(g + 1)[k] == counter + 1
        if g < n:
            assert (k, counter) == (sources[g], counters[g])


def test_one_source_keeps_the_single_folder_order(two_folders):
    sources, counters = MixtureOrder([1.0]).assign(np.arange(3 * MIX_BLOCK))
    assert (sources == 0).all() and (counters == np.arange(3 * MIX_BLOCK)).all()
    layout = BatchLayout(8, 4, 1, 0)
    data = open_training_data(DataConfig(path=str(two_folders[0]), seq_len=SEQ_LEN), 1000, layout, seed=5)
    assert isinstance(data.train_batches, TrainBatches) and not data.is_mixture and data.tokens_seen(10) == {}
    plain = TrainBatches(TokenWindows(two_folders[0], "train", SEQ_LEN), layout, seed=5)
    assert (data.train_batches.window_ids(17, 1) == plain.window_ids(17, 1)).all()


@pytest.mark.parametrize("weights", [(0.7, 0.3), (0.5, 0.3, 0.2), (0.9, 0.05, 0.05), (3, 1)])
@pytest.mark.parametrize("global_batch", [1, 8, 96])
def test_realised_proportions_over_1000_steps(weights, global_batch):
    order = MixtureOrder(list(weights))
    target = np.array(weights) / sum(weights)
    n = 1000 * global_batch
    realised = order.counts(n) / n
    assert np.abs(realised - target).max() <= 0.01, realised
    # Also every window of 100 steps (the pattern spreads each source evenly, not in runs).
    sources, _ = order.assign(np.arange(n))
    for start in range(0, n, 100 * global_batch):
        share = np.bincount(sources[start : start + 100 * global_batch], minlength=len(weights)) / (100 * global_batch)
        assert np.abs(share - target).max() <= 0.01 + 1 / (100 * global_batch)


def test_sources_with_different_tokenizers_are_refused(tmp_path, two_sources, corpus_dir):
    from lmrecipe.data.prepare.pipeline import prepare

    other = tmp_path / "other"
    prepare(output=other, inputs=[corpus_dir], vocab_size=300, val_fraction=0.1, num_proc=1)
    cfg = load_config(None, [sources_arg((two_sources[0], 1, None), (other, 1, None))])
    with pytest.raises(UserError) as err:
        check_sources(cfg.data)
    message = str(err.value)
    assert f"data.sources[1] (other, {other}) does not share the tokenizer of data.sources[0] (code, {two_sources[0]})" in message
    assert "vocab_size 384 vs 300" in message and "tokenizer.json sha256" in message and "--tokenizer" in message
    check_sources(load_config(None, [sources_arg((two_sources[0], 1, None), (two_sources[1], 1, None))]).data)
