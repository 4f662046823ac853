"""The per-layer instruments (``logging.layer_stats``): the parts partition the parameters, the parts' gradient norms
add up to the global pre-clip norm, the update ratio is the weights' change, activations and logits on one
micro-batch, the heat map. Elsewhere: the refusals (tests/unit/test_config.py's TRIGGERS); ZeRO-1/2/3 on 2 processes
(tests/integration/test_document_masking.py, tests/integration/test_checkpoint.py); no host sync at an unlogged step
(tests/unit/test_step.py)."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from helpers import TINY_OVERRIDES
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, Qwen3Config

from lmrecipe.config import load_config
from lmrecipe.model.loss import causal_lm_loss, chunked_head, use_chunked_loss
from lmrecipe.observe.layer_plots import layer_grid
from lmrecipe.train.callbacks.layer_stats import parameter_parts

VOCAB = 300


def build(config):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


MODELS = {
    "llama": lambda: build(LlamaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                                       intermediate_size=64)),
    "llama-tied": lambda: build(LlamaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3,
                                            num_attention_heads=4, intermediate_size=64, tie_word_embeddings=True)),
    "qwen3": lambda: build(Qwen3Config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, head_dim=8, intermediate_size=64)),
    "gpt2": lambda: build(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=16)),
}


@pytest.mark.parametrize("name", MODELS)
def test_the_parts_partition_the_parameters(name):
    model = MODELS[name]()
    use_chunked_loss(model, 8)  # the chunked head keeps the output layer's parameter and name
    parts = parameter_parts(model)
    listed = [p for params in parts.values() for _, p in params]
    assert len(listed) == len({id(p) for p in listed})  # no parameter in two parts
    assert {id(p) for p in listed} == {id(p) for p in model.parameters()}  # every parameter in one
    blocks = model.config.num_hidden_layers
    assert list(parts)[:blocks + 1] == ["embed", *(f"block_{i:02d}" for i in range(blocks))]
    assert ("head" in parts) == (not model.config.tie_word_embeddings)
    assert parts["final_norm"] and all("norm" in n or "ln_f" in n for n, _ in parts["final_norm"])
    if name == "qwen3":  # the QK-norm weights belong to their block
        assert any("q_norm" in n for n, _ in parts["block_00"])


def test_the_chunked_head_measures_the_largest_logit_without_holding_the_logits():
    full = MODELS["llama"]()
    chunked = copy.deepcopy(full)
    use_chunked_loss(chunked, 7)
    generator = torch.Generator().manual_seed(1)
    inputs, targets = (torch.randint(0, VOCAB, (2, 13), generator=generator) for _ in range(2))
    head = chunked_head(chunked)
    head.max_abs_logit = torch.zeros(())
    with torch.no_grad():
        causal_lm_loss(chunked, inputs, targets)
        want = full(input_ids=inputs).logits.abs().max()
    assert head.max_abs_logit.item() == pytest.approx(want.item(), rel=1e-6)


def test_a_run_logs_every_parts_figures_at_its_logged_steps(tmp_path, tiny_data):
    """One process, no DeepSpeed, the chunked loss: at every logged step the parts' gradient norms add up to the
    logged pre-clip norm; the final norm's update ratio after Adam's first step is the learning rate (its weights
    start at 1, Adam's first step moves each by the learning rate, no weight decay on norms); layers.png."""
    from lmrecipe.train.trainer import train

    out = tmp_path / "run"
    train(load_config("recipes/tiny.yaml", [
        f"out_dir={out}", f"data.path={tiny_data}", *TINY_OVERRIDES, "train.max_steps=4", "logging.log_every_steps=3",
        "logging.layer_stats=true", "train.loss_chunk_tokens=16", "train.eval_every_steps=0",
        "checkpoint.every_steps=0", "checkpoint.resume=none", "logging.plots=true"]))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in rows] == [1, 3, 4]
    parts = ["embed", "block_00", "block_01", "final_norm", "head"]
    for row in rows:
        assert [k.partition("/")[2] for k in row if k.startswith("grad_norm/")] == parts
        squares = sum(row[f"grad_norm/{part}"] ** 2 for part in parts)
        assert math.sqrt(squares) == pytest.approx(row["grad_norm"], rel=1e-5)
        assert all(row[f"update_ratio/{part}"] > 0 and row[f"param_norm/{part}"] > 0 for part in parts)
        assert row["act_rms/block_00"] > 0 and row["act_rms/block_01"] > 0 and row["max_abs_logit"] > 0
    assert rows[0]["update_ratio/final_norm"] == pytest.approx(rows[0]["lr"], rel=1e-4)
    assert abs(rows[0]["param_norm/final_norm"] - math.sqrt(64)) <= math.sqrt(64) * rows[0]["lr"] * 1.001
    assert (out / "layers.png").stat().st_size > 10_000
    grid_parts, steps, grid = layer_grid(rows, "grad_norm")
    assert grid_parts == parts and steps == [1, 3, 4]
    assert grid[0][0] == pytest.approx(math.log10(rows[0]["grad_norm/embed"]))
