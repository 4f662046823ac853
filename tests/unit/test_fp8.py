"""train.precision=fp8: which linear layers turn float8, a short run that learns, and an export a plain
``from_pretrained`` loads (torchao emulates the float8 matmuls on this CPU)."""

from __future__ import annotations

import pytest
import torch
from helpers import TINY_OVERRIDES, losses
from torch import nn

from lmrecipe.config import load_config
from lmrecipe.model.build import fp8_layer_filter


def test_first_last_and_odd_sized_layers_stay_in_bf16():
    model = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 64), nn.Linear(64, 40), nn.Linear(40, 16), nn.Linear(16, 8))
    converts, kept = fp8_layer_filter(model)
    assert kept == {"0": "first linear layer", "2": "40x64 not divisible by 16", "3": "16x40 not divisible by 16",
                    "4": "last linear layer"}
    assert [converts(m, n) for n, m in model.named_children()] == [False, True, False, False, False]
    assert converts(model[1], "_orig_mod.1")  # names of a compiled model


@pytest.fixture
def own_accelerator_state():
    """Accelerate keeps one AcceleratorState per process and refuses another precision in it (a script trains
    once per process): the fp8 run starts from none and leaves none behind for the fp32 runs of other tests."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state()
    yield
    AcceleratorState._reset_state()


def test_fp8_run_learns_and_exports_plain_weights(tmp_path, tiny_data, caplog, own_accelerator_state):
    from torchao.float8.float8_linear import Float8Linear
    from transformers import AutoModelForCausalLM

    from lmrecipe.train.trainer import train

    cfg = load_config("recipes/tiny.yaml", [
        f"out_dir={tmp_path / 'run'}", f"data.path={tiny_data}", *TINY_OVERRIDES, "train.precision=fp8",
        "train.max_steps=5", "train.micro_batch_size=8", "optim.lr=3e-3", "train.eval_every_steps=0",
        "checkpoint.every_steps=0", "checkpoint.export_at_end=true",
    ])
    with caplog.at_level("INFO", logger="lmrecipe.train.setup"):
        train(cfg)
    assert "fp8: 13 of 15 linear layers train with float8 matmuls" in caplog.text  # q_proj of layer 0, lm_head stay
    curve = losses(tmp_path / "run")
    assert curve[-1][1] < curve[0][1] - 0.2, curve
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "export")
    assert not any(isinstance(m, Float8Linear) for m in exported.modules())
    assert all(p.dtype == torch.bfloat16 and torch.isfinite(p).all() for p in exported.parameters())


def test_fp8_without_torchao_is_refused(monkeypatch):
    import sys

    from lmrecipe.parallel.precision import check_fp8
    from lmrecipe.errors import UserError

    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # an import of it raises ImportError
    with pytest.raises(UserError, match="pip install torchao"):
        check_fp8()
