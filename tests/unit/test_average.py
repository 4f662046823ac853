"""Checkpoint averaging (``lmrecipe/average.py``): the average equals an independent one, reads one tensor at a
time, refuses bad input with the fix, and its export evaluates.

The checkpoints are run B's of test_schedule_wsd.py (WSD, 24 steps, a checkpoint every 5 steps, all kept), built
once a session (``build_once``). ZeRO-2 checkpoints of 2 processes and the script's exit codes:
tests/integration/test_average.py.
"""

from __future__ import annotations

import math
import weakref
from pathlib import Path

import pytest
import torch
from helpers import TINY_OVERRIDES, independent_average, wsd_run

from lmrecipe.average import _Weights, average_checkpoints, average_state_dict, parse_weights, select_checkpoints
from lmrecipe.config import load_config
from lmrecipe.errors import UserError
from lmrecipe.export import checkpoint_state_dict

def exact_average(checkpoints: list[Path], weights: list[float]) -> dict[str, torch.Tensor]:
    states = [checkpoint_state_dict(c, torch.float32) for c in checkpoints]
    return {name: sum(w * s[name].double() for w, s in zip(weights, states)) for name in states[0]}


def test_the_average_of_the_last_checkpoints_equals_an_independent_average(tmp_path, tmp_path_factory, tiny_data):
    from safetensors.torch import load_file

    from lmrecipe.evaluation.evaluate import evaluate_path

    run = wsd_run(tmp_path_factory, tiny_data, 24)
    checkpoints = select_checkpoints([run], last=3)
    assert [c.name for c in checkpoints] == ["step_00000015", "step_00000020", "step_00000024"]
    for text, weights in ((None, [1 / 3] * 3), ("1,1,2", [0.25, 0.25, 0.5])):
        got = average_checkpoints(checkpoints, tmp_path / "avg", weights=parse_weights(text, 3), overwrite=True)
        assert got.weights == pytest.approx(weights, abs=0)
        written = {}
        for shard in sorted((tmp_path / "avg").glob("model-*.safetensors")):
            written.update(load_file(shard))
        want = independent_average(checkpoints, got.weights)
        assert sorted(written) == sorted(want)
        assert max((written[n] - want[n]).abs().max().item() for n in want) <= 1e-7
        exact = exact_average(checkpoints, got.weights)  # fp32 accumulation: within 2 ulp of the exact mean
        assert max(((written[n].double() - exact[n]).abs() / exact[n].abs().clamp_min(1e-3)).max().item()
                   for n in want) <= 2.4e-7
        first = checkpoint_state_dict(checkpoints[0], torch.float32)
        assert max((written[n] - first[n]).abs().max().item() for n in want) > 1e-4  # not one checkpoint's weights
    card = (tmp_path / "avg" / "README.md").read_text()
    assert "the average of 3 checkpoints (folder and weight: step_00000015 (0.25), step_00000020 (0.25)" in card
    result, _ = evaluate_path(tmp_path / "avg", tiny_data, max_batches=2, batch_size=4)
    assert math.isfinite(result["loss"]) and 0 < result["loss"] < 10


def test_averaging_reads_one_tensor_of_one_checkpoint_at_a_time(tmp_path_factory, tiny_data, monkeypatch):
    run = wsd_run(tmp_path_factory, tiny_data, 24)
    alive: list[weakref.ref] = []
    most = [0]
    read = _Weights.read

    def counting(self, name):
        tensor = read(self, name)
        alive[:] = [r for r in alive if r() is not None] + [weakref.ref(tensor)]
        most[0] = max(most[0], len(alive))
        return tensor

    monkeypatch.setattr(_Weights, "read", counting)
    checkpoints = select_checkpoints([run], last=4)
    out = average_state_dict(checkpoints, parse_weights(None, 4))
    assert most[0] == 1 and len(out) > 4  # each checkpoint's tensor is dropped before the next is read


def test_bad_averaging_input_is_refused_with_the_fix(tmp_path, tmp_path_factory, tiny_data):
    run = wsd_run(tmp_path_factory, tiny_data, 24)
    with pytest.raises(UserError, match="holds 5 complete checkpoint.*fewer than --last 6.*keep_last"):
        select_checkpoints([run], last=6)
    with pytest.raises(UserError, match="--last 2 takes one run folder"):
        select_checkpoints([run, run], last=2)
    with pytest.raises(UserError, match="listed twice"):
        select_checkpoints([run / "checkpoints" / "step_00000005"] * 2, last=None)
    with pytest.raises(UserError, match="is not a training checkpoint"):
        select_checkpoints([tmp_path], last=None)
    with pytest.raises(UserError, match=r"--weights 1,x must be 2 comma-separated numbers.*--weights 1,1"):
        parse_weights("1,x", 2)
    with pytest.raises(UserError, match="must be 3 comma-separated"):
        parse_weights("0,0,0", 3)
    checkpoints = select_checkpoints([run], last=2)
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine")
    with pytest.raises(UserError, match="already exists and is not empty.*--overwrite"):
        average_checkpoints(checkpoints, tmp_path / "taken")
    assert [p.name for p in (tmp_path / "taken").iterdir()] == ["keep.txt"]
    other = tmp_path / "other"
    other_ckpt = other / "checkpoints" / "step_00000001"
    from lmrecipe.train.trainer import train

    train(load_config("recipes/tiny.yaml", [f"out_dir={other}", f"data.path={tiny_data}", *TINY_OVERRIDES,
                                            "model.num_layers=1", "train.max_steps=1", "train.eval_every_steps=0"]))
    with pytest.raises(UserError, match="holds another model than .*num_hidden_layers: 2 -> 1"):
        average_checkpoints([checkpoints[0], other_ckpt], tmp_path / "mixed")
    assert not (tmp_path / "mixed").exists()


def test_autoep_checkpoints_are_refused_naming_autoep_and_the_export(tmp_path, monkeypatch):
    import lmrecipe.average as average

    config = {"distributed": {"expert_parallel_size": 2, "expert_layer": "auto"}, "model": {"arch": "qwen3_moe"}}
    monkeypatch.setattr(average, "read_checkpoint", lambda ckpt: {"config": config})
    checkpoints = [tmp_path / "step_00000002", tmp_path / "step_00000004"]
    for call in (lambda: average_checkpoints(checkpoints, tmp_path / "avg"),
                 lambda: average.average_state_dict(checkpoints, [0.5, 0.5])):
        with pytest.raises(UserError, match=r"(?s)DeepSpeed AutoEP.*does not average AutoEP.*tools/export_hf.py"):
            call()
    assert not (tmp_path / "avg").exists()
