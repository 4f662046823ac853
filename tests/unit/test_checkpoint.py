"""Checkpoints: exact resume (no DeepSpeed, ZeRO-2, ZeRO-3), kill -9 during a save (synchronous or in the background),
background writes equal to synchronous ones, preemption, retention, bad input."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from lmrecipe.checkpoint.storage import (
    LATEST,
    STATE_FILE,
    find_resume_checkpoint,
    prune_checkpoints,
    rng_state_tensors,
    set_rng_state,
    step_dir_name,
)
from lmrecipe.errors import UserError

# ---------------------------------------------------------------------------------------------- unit


def test_rng_state_round_trips_through_safetensors(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    random.gauss(0, 1)  # leave a cached gaussian in the python state
    np.random.standard_normal()
    tensors, metadata = rng_state_tensors()
    save_file(tensors, tmp_path / "rng.safetensors", metadata=metadata)
    expected = (torch.rand(4), np.random.rand(4), [random.random() for _ in range(4)], random.gauss(0, 1))
    torch.manual_seed(99), np.random.seed(99), random.seed(99)
    with safe_open(tmp_path / "rng.safetensors", framework="pt") as fh:
        set_rng_state({k: fh.get_tensor(k) for k in fh.keys()}, fh.metadata())
    again = (torch.rand(4), np.random.rand(4), [random.random() for _ in range(4)], random.gauss(0, 1))
    assert torch.equal(expected[0], again[0]) and np.array_equal(expected[1], again[1]) and expected[2:] == again[2:]


def fake_checkpoints(root: Path, val_losses: dict[int, float | None]) -> None:
    for step, val_loss in val_losses.items():
        (root / step_dir_name(step)).mkdir(parents=True)
        (root / step_dir_name(step) / STATE_FILE).write_text(json.dumps({"val_loss": val_loss}))


def test_keep_last_prunes_oldest_but_keeps_the_best_apart(tmp_path):
    fake_checkpoints(tmp_path, {1: 5.0, 2: 3.0, 3: None, 4: 4.5, 5: 4.2})
    (tmp_path / ".tmp_step_00000006").mkdir()  # a save in progress is not a checkpoint: never counted or pruned
    removed = prune_checkpoints(tmp_path, keep_last=2)
    assert sorted(p.name for p in removed) == [step_dir_name(1), step_dir_name(3)]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp_step_00000006", "best", *map(step_dir_name, (2, 4, 5))]
    assert (tmp_path / "best").read_text().strip() == step_dir_name(2)


def test_resume_auto_follows_latest_or_the_newest_complete_folder(tmp_path):
    assert find_resume_checkpoint("auto", tmp_path) is None
    assert find_resume_checkpoint("none", tmp_path) is None
    fake_checkpoints(tmp_path, {2: None, 4: None})
    (tmp_path / step_dir_name(6)).mkdir()  # no train_state.json: an interrupted save
    assert find_resume_checkpoint("auto", tmp_path) == tmp_path / step_dir_name(4)
    (tmp_path / LATEST).write_text(step_dir_name(2) + "\n")
    assert find_resume_checkpoint("auto", tmp_path) == tmp_path / step_dir_name(2)
    assert find_resume_checkpoint(str(tmp_path), tmp_path) == tmp_path / step_dir_name(2)  # a checkpoints folder
    (tmp_path / LATEST).write_text(step_dir_name(99) + "\n")
    with pytest.raises(UserError, match=r"latest points to 'step_00000099', which is not a checkpoint folder"):
        find_resume_checkpoint("auto", tmp_path)
