"""The training step as an accelerator sees it: no host syncs between sync points, prefetched input, compile."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import run_train

# ---------------------------------------------------------------------------------------------- compile


@pytest.fixture(scope="module")
def eager_losses(tmp_path_factory, tiny_data):
    out = tmp_path_factory.mktemp("eager")
    run_train(out, tiny_data, ["train.max_steps=5"])
    return train_losses(out)


def train_losses(out) -> list[float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


@pytest.mark.slow
@pytest.mark.parametrize("ds_config", ["null", "zero3"])
def test_compiled_training_matches_eager(tmp_path, tiny_data, eager_losses, ds_config):
    """torch.compile (inductor on CPU): without DeepSpeed, and DeepSpeed's engine.compile() under ZeRO-3, whose
    parameter hooks are what compilation must get through (ZeRO-2 leaves the forward as it is)."""
    out = tmp_path / "compiled"
    proc = run_train(out, tiny_data, ["train.max_steps=5", "train.compile=true",
                                      f"distributed.deepspeed_config={ds_config}"], timeout=900)
    losses = train_losses(out)
    assert len(losses) == 5
    assert np.max(np.abs(np.array(losses) - np.array(eager_losses))) < 1e-5
    assert "torch.compile's compilation included" in proc.stderr
