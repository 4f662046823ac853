"""optim.name=muon: which parameters Muon gets, its learning rates, what DeepSpeed must be told, and a short run
that learns and resumes exactly."""

from __future__ import annotations

import pytest
import torch
from helpers import LOSS_TOL, TINY_OVERRIDES, losses
from torch import nn

from lmrecipe.config import load_config
from lmrecipe.data.batches import BatchLayout
from lmrecipe.parallel.deepspeed_config import load_deepspeed_config
from lmrecipe.errors import UserError
from lmrecipe.optim import build_optimizer, optimizer_param_names, set_lr


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.hidden = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 10, bias=False)

    def get_output_embeddings(self):
        return self.head


@pytest.fixture
def eager_muon():
    """Muon's Newton-Schulz kernels are torch.compiled by DeepSpeed; eager gives the same numbers without a
    cold-cache compile of every matrix shape (about 20 s on this CPU)."""
    with torch._dynamo.config.patch(disable=True):
        yield


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest(eager_muon):
    cfg = load_config(None, ["optim.name=muon", "optim.lr=1e-3", "optim.muon_lr=0.02", "optim.weight_decay=0.1"])
    model = TinyLM()
    optimizer = build_optimizer(model, cfg.optim, cpu_offload=False)
    muon, adam_decay, adam_rest = optimizer.param_groups
    assert muon["use_muon"] and [p.shape for p in muon["params"]] == [(16, 8), (8, 16)]  # largest first
    assert not adam_decay["use_muon"] and adam_decay["params"] == [model.head.weight]
    assert adam_decay["weight_decay"] == muon["weight_decay"] == 0.1 and adam_rest["weight_decay"] == 0.0
    assert {id(p) for p in adam_rest["params"]} == {id(model.embed.weight), id(model.hidden.bias), id(model.down.bias),
                                                      id(model.norm.weight), id(model.norm.bias)}
    assert all(p.use_muon == (p.dim() == 2 and p is not model.embed.weight and p is not model.head.weight)
               for p in model.parameters())
    # The names a checkpoint's numbered entries get follow the optimizer's own order.
    names = optimizer_param_names(model, False, "muon")
    order = {id(p): n for n, p in model.named_parameters()}
    assert [n[0] for n in names] == [order[id(p)] for g in optimizer.param_groups for p in g["params"]]
    set_lr(optimizer, 5e-4)  # the schedule moves Muon's rate in proportion
    assert muon["lr"] == pytest.approx(0.01) and adam_decay["lr"] == adam_rest["lr"] == 5e-4


def _ds(name: str, *overrides: str) -> dict:
    cfg = load_config(None, ["optim.name=muon", "optim.grad_clip=0", *overrides])
    return load_deepspeed_config(f"ds_configs/{name}.json", cfg.optim, cfg.distributed, BatchLayout.from_config(cfg.train, 1),
                                 "fp32")


def test_deepspeed_settings_muon_needs_are_filled_or_refused():
    assert _ds("zero3")["zero_optimization"]["reduce_scatter"] is False  # DeepSpeed refuses Muon with it
    assert _ds("zero2")["zero_optimization"]["reduce_scatter"] is True  # ZeRO-1/2 take Muon with it
    with pytest.raises(UserError, match="optim.grad_clip=0"):
        load_config(None, ["optim.name=muon", "optim.grad_clip=1.0", "distributed.deepspeed_config=zero2"])
    load_config(None, ["optim.name=muon", "optim.grad_clip=1.0"])  # clipped as it should be without DeepSpeed
    with pytest.raises(UserError, match="offload"):
        _ds("zero2_offload")
    with pytest.raises(UserError, match="optim.name"):
        load_config(None, ["optim.name=sgd"])
    with pytest.raises(UserError, match="muon_momentum"):
        load_config(None, ["optim.muon_momentum=1.0"])
    from lmrecipe.planning.zero_comparison import config_overrides  # tools/compare_zero.py's and estimate_memory's +muon rows

    assert config_overrides("zero3+muon") == ["optim.name=muon", "optim.grad_clip=0"]


def test_muon_run_learns_and_resumes_exactly(tmp_path, tiny_data, eager_muon):
    """6 steps without DeepSpeed; a second run resumed from step 3 repeats steps 4-6 to the last bit of fp32; an
    AdamW run cannot resume from Muon's state."""
    from lmrecipe.train.trainer import train

    common = [f"data.path={tiny_data}", *TINY_OVERRIDES, "optim.name=muon", "train.max_steps=6",
              "checkpoint.every_steps=3", "train.eval_every_steps=0", "optim.lr=3e-3", "optim.muon_lr=0.03"]
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    train(load_config("recipes/tiny.yaml", [f"out_dir={full}", *common]))
    reference = losses(full)
    assert reference[-1][1] < reference[0][1] - 0.2, reference
    train(load_config("recipes/tiny.yaml", [f"out_dir={resumed}", *common,
                                            f"checkpoint.resume={full}/checkpoints/step_00000003"]))
    after = losses(resumed)
    assert [s for s, _ in after] == [4, 5, 6]
    assert max(abs(loss - dict(reference)[s]) for s, loss in after) <= LOSS_TOL
    adamw = [*common, "optim.name=adamw", f"checkpoint.resume={full}/checkpoints/step_00000003"]
    with pytest.raises(UserError, match="holds muon optimizer state; this run trains with optim.name=adamw"):
        train(load_config("recipes/tiny.yaml", [f"out_dir={tmp_path / 'adamw'}", *adamw]))


def test_memory_estimate_counts_one_moment_for_muon_matrices():
    from lmrecipe.parallel.topology import ZeroSetup
    from lmrecipe.planning.memory import estimate_model_states, model_shape
    from lmrecipe.model.build import build_hf_config

    cfg = load_config(None, ["model.hidden_size=64", "model.num_layers=2", "model.intermediate_size=128"])
    shape = model_shape(build_hf_config(cfg.model, 384, cfg.data.seq_len))
    # 2 layers x (4 attention projections of 64x64 + 3 MLP matrices of 64x128); not the embeddings or the head
    assert shape.muon_params == 2 * (4 * 64 * 64 + 3 * 64 * 128)
    for setup, ranks in ((ZeroSetup(), 1), (ZeroSetup(stage=2, deepspeed=True), 4), (ZeroSetup(stage=3, deepspeed=True), 4)):
        adamw = estimate_model_states(shape, setup, ranks, ranks, "bf16", 1)["optimizer"]
        muon = estimate_model_states(shape, setup, ranks, ranks, "bf16", 1, optimizer="muon")["optimizer"]
        assert adamw - muon == pytest.approx(4 * shape.muon_params / (ranks if setup.stage else 1))
