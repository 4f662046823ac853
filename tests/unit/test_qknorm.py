"""The QK-norm recipes (Qwen3's block): they load, and the tiny one trains, resumes, exports and loads with
transformers' ``AutoModelForCausalLM``."""

from __future__ import annotations

import json

import torch
from helpers import ROOT, TINY_OVERRIDES

from lmrecipe.config import load_config


def test_the_1b_recipe_is_llama_1b_on_qwen3_blocks():
    qk, llama = load_config(ROOT / "recipes" / "qwen3_1b_qknorm.yaml"), load_config(ROOT / "recipes" / "llama_1b.yaml")
    assert qk.model.arch == "qwen3" and qk.model.hidden_size // qk.model.num_heads == qk.model.extra["head_dim"]
    assert (qk.model.num_layers, qk.model.num_kv_heads, qk.optim, qk.data) == (
        llama.model.num_layers, llama.model.num_kv_heads, llama.optim, llama.data)  # the rest comes from its base
    assert qk.train.z_loss > 0 and qk.logging.layer_stats


def test_the_tiny_qknorm_recipe_trains_resumes_exports_and_loads(tmp_path, tiny_data):
    from transformers import AutoModelForCausalLM

    from lmrecipe.train.trainer import train

    out = tmp_path / "run"
    common = [f"out_dir={out}", f"data.path={tiny_data}", *TINY_OVERRIDES, "model.extra={head_dim: 16}",
              "train.eval_every_steps=0", "checkpoint.every_steps=1", "checkpoint.export_dtype=fp32",
              "logging.layer_stats=false"]  # the instruments' own tests are in test_layer_stats.py
    train(load_config(ROOT / "recipes" / "tiny_qknorm.yaml", [*common, "train.max_steps=1"]))
    state = train(load_config(ROOT / "recipes" / "tiny_qknorm.yaml", [*common, "train.max_steps=2",
                                                                      "checkpoint.export_at_end=true"]))
    assert state.step == 2
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]  # step 1, then the resume's step 2
    assert json.loads((out / "run_meta.json").read_text())["launches"][-1]["resumed_from"]
    model = AutoModelForCausalLM.from_pretrained(out / "export")
    assert type(model).__name__ == "Qwen3ForCausalLM"
    q_norm = model.model.layers[0].self_attn.q_norm.weight
    assert q_norm.shape == (16,) and not torch.equal(q_norm, torch.ones(16))  # trained QK-norm weights, exported
    with torch.no_grad():
        logits = model(input_ids=torch.arange(8)[None]).logits
    assert logits.shape == (1, 8, model.config.vocab_size) and torch.isfinite(logits).all()
