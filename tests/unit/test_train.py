"""The training loop end to end: metrics, schedule, skips, and the ZeRO matrix on 2 CPU processes."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lmrecipe.config import load_config
from lmrecipe.optim import lr_at, param_groups

# ---------------------------------------------------------------------------------------------- unit


def test_lr_schedule_warmup_then_cosine_to_min():
    cfg = load_config(None, ["optim.lr=1e-3", "optim.min_lr=1e-4", "schedule.warmup_steps=10", "train.max_steps=111"])
    lrs = [lr_at(s, 111, cfg.optim, cfg.schedule) for s in range(111)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)  # linear warmup reaches the peak
    assert all(b > a for a, b in zip(lrs[:10], lrs[1:10]))
    assert lrs[10] == pytest.approx(1e-3)
    assert lrs[60] == pytest.approx(1e-4 + 0.9e-3 * 0.5)  # half way through the cosine
    assert all(b <= a for a, b in zip(lrs[10:], lrs[11:]))
    assert lrs[110] == pytest.approx(1e-4, abs=1e-15)  # the last trained step is at min_lr exactly


def test_weight_decay_on_matrices_only():
    cfg = load_config(None)
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4), nn.LayerNorm(4))
    decay, no_decay = param_groups(model, cfg.optim)
    assert decay["params"] == [model[1].weight] and decay["weight_decay"] == cfg.optim.weight_decay
    assert {id(p) for p in no_decay["params"]} == {id(model[0].weight), id(model[1].bias), id(model[2].weight), id(model[2].bias)}
    assert no_decay["weight_decay"] == 0.0
    cfg = load_config(None, ["optim.decay_embeddings=true"])
    assert {id(p) for p in param_groups(model, cfg.optim)[0]["params"]} == {id(model[0].weight), id(model[1].weight)}


@pytest.mark.parametrize("fused", [True, False])
def test_non_finite_gradients_skip_the_update(fused):
    """Fused AdamW (the recipe's) skips on the device; any other optimizer falls back to a host check."""
    from accelerate import Accelerator

    from lmrecipe.train.step import optimizer_step

    accelerator = Accelerator(cpu=True)
    model = nn.Linear(3, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, fused=fused)
    model(torch.ones(2, 3)).sum().backward()
    optimizer_step(model, optimizer, accelerator, grad_clip=1.0, deepspeed=False)  # creates the moments
    before = [p.detach().clone() for p in model.parameters()]
    moments = [{k: v.clone() for k, v in optimizer.state[p].items()} for p in model.parameters()]
    model(torch.full((2, 3), float("nan"))).sum().backward()
    norm, skipped = optimizer_step(model, optimizer, accelerator, grad_clip=1.0, deepspeed=False)
    assert bool(skipped) and math.isnan(float(norm))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    for saved, p in zip(moments, model.parameters()):  # moments and step counts untouched too
        assert all(torch.equal(saved[k], optimizer.state[p][k]) for k in saved)
    assert all(p.grad is None for p in model.parameters())
    model(torch.ones(2, 3)).sum().backward()
    norm, skipped = optimizer_step(model, optimizer, accelerator, grad_clip=1.0, deepspeed=False)
    assert not bool(skipped) and math.isfinite(float(norm))
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
