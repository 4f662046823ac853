"""DeepSeek-V3 and Qwen3.5-MoE from recipes (docs/moe.md): the recipe's keys land in the model class's config and
shape the built model, each refusal names its fix, and the FLOPs per token, the estimator's activations and the
planner count latent attention at its real head widths and linear-attention layers without an S^2 term (against hand
calculations and saved-tensor measurements of small shapes)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from helpers import ROOT, saved_bytes

from lmrecipe.config import load_config
from lmrecipe.errors import UserError
from lmrecipe.model.build import (
    attention_width,
    build_hf_config,
    build_model,
    flops_per_token,
    param_counts,
)
from lmrecipe.planning.memory import estimate_activations, model_shape

DEEPSEEK = ROOT / "recipes" / "tiny_deepseek_v3.yaml"
QWEN = ROOT / "recipes" / "tiny_qwen3_5_moe.yaml"
VOCAB, SEQ = 384, 64


def built(recipe, overrides=()):
    cfg = load_config(recipe, list(overrides))
    hf_config = build_hf_config(cfg.model, VOCAB, cfg.data.seq_len)
    return cfg, hf_config, build_model(cfg.model, cfg.train, hf_config)


def test_deepseek_v3_keys_land_in_its_config_and_shape_the_model():
    cfg, c, model = built(DEEPSEEK)
    m = cfg.model
    assert (type(c).__name__, c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads) == (
        "DeepseekV3Config", m.hidden_size, m.num_layers, m.num_heads, m.num_heads)
    assert (c.n_routed_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.n_shared_experts,
            c.intermediate_size) == (m.num_experts, m.experts_per_token, m.expert_intermediate_size, 1,
                                     m.intermediate_size)
    assert (c.q_lora_rank, c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.n_group,
            c.topk_group, c.routed_scaling_factor, c.first_k_dense_replace) == (32, 16, 16, 8, 16, 4, 2, 2.5, 1)
    layers = model.model.layers
    assert len(layers) == m.num_layers and model.model.embed_tokens.weight.shape == (VOCAB, m.hidden_size)
    attn = layers[0].self_attn
    assert attn.q_a_proj.weight.shape == (32, 64) and attn.q_b_proj.weight.shape == (4 * (16 + 8), 32)
    assert attn.kv_a_proj_with_mqa.weight.shape == (16 + 8, 64) and attn.kv_b_proj.weight.shape == (4 * (16 + 16), 16)
    assert attn.o_proj.weight.shape == (64, 4 * 16)
    assert layers[0].mlp.gate_proj.weight.shape == (m.intermediate_size, 64)  # the dense first layer
    for layer in layers[1:]:
        mlp = layer.mlp
        assert mlp.experts.gate_up_proj.shape == (8, 2 * 32, 64) and mlp.experts.down_proj.shape == (8, 64, 32)
        assert mlp.shared_experts.gate_proj.weight.shape == (32, 64)
        assert mlp.gate.e_score_correction_bias.shape == (8,) and mlp.gate.e_score_correction_bias.dtype == torch.float32


def test_deepseek_v3_q_lora_rank_0_projects_the_queries_directly():
    _, c, model = built(DEEPSEEK, ["model.q_lora_rank=0"])
    attn = model.model.layers[0].self_attn
    assert c.q_lora_rank is None and attn.q_proj.weight.shape == (4 * 24, 64) and "q_a_proj" not in dict(attn.named_children())


def test_qwen3_5_moe_keys_land_in_its_config_and_shape_the_model():
    cfg, c, model = built(QWEN)
    m = cfg.model
    assert (type(c).__name__, c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads,
            c.head_dim) == ("Qwen3_5MoeTextConfig", m.hidden_size, m.num_layers, m.num_heads, m.num_kv_heads, 16)
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.shared_expert_intermediate_size) == (
        8, 2, 32, 32)
    assert c.layer_types == ["linear_attention", "full_attention"] * 2
    assert (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim) == (
        2, 4, 16, 16)
    layers = model.model.layers
    assert len(layers) == m.num_layers and model.model.embed_tokens.weight.shape == (VOCAB, m.hidden_size)
    assert layers[0].linear_attn.in_proj_qkv.weight.shape == (2 * 2 * 16 + 4 * 16, 64)
    assert layers[1].self_attn.q_proj.weight.shape == (2 * 4 * 16, 64)  # queries and their gate
    assert not hasattr(layers[0], "self_attn") and not hasattr(layers[1], "linear_attn")
    assert layers[3].mlp.experts.gate_up_proj.shape == (8, 64, 64) and layers[3].mlp.shared_expert_gate.weight.shape == (1, 64)


def test_qwen3_5_moe_head_dim_from_extra_and_every_layer_full_attention():
    _, c, _ = built(QWEN, ["model.full_attention_every=1", "model.extra={head_dim: 32}"])
    assert c.layer_types == ["full_attention"] * 4 and c.head_dim == 32


@pytest.mark.parametrize("overrides, match", [
    (["model.arch=qwen3_5_moe"], "model.arch=qwen3_5_moe is Qwen3.5-MoE's multimodal config .* Set "
                                 "model.arch=qwen3_5_moe_text"),
    (["model.arch=qwen3_moe", "model.shared_experts=0", "model.router_aux_loss_coef=0.001"],
     r"model.kv_lora_rank=16 \(deepseek_v3\).*model.arch=qwen3_moe. Remove them"),
    (["model.router_aux_loss_coef=0.001"], "computes no load-balancing loss.*Set model.router_aux_loss_coef=0"),
    (["model.num_kv_heads=2"], "latent attention expands .* Set model.num_kv_heads=null"),
    (["model.expert_groups=3"], "model.expert_groups=3 must divide model.num_experts=8"),
    (["model.expert_groups_per_token=5"], "model.expert_groups_per_token=5 cannot exceed model.expert_groups=4"),
    (["model.experts_per_token=5"], r"model.experts_per_token=5 exceeds the experts of .* \(2 x 2\)"),
    (["model.dense_layers=3"], "leaves none of the model.num_layers=3 layers with experts"),
    (["model.kv_lora_rank=-1"], "model.kv_lora_rank=-1 must be positive, or null"),
])
def test_deepseek_v3_refusals_name_the_fix(overrides, match):
    with pytest.raises(UserError, match=match):
        load_config(DEEPSEEK, overrides)


def test_qwen3_5_moe_refusals_name_the_fix():
    with pytest.raises(UserError, match="model.linear_value_heads=3 must be a multiple of model.linear_key_heads=2"):
        load_config(QWEN, ["model.linear_value_heads=3"])
    with pytest.raises(UserError, match=r"model.full_attention_every=2 \(qwen3_5_moe_text\)"):
        load_config(QWEN, ["model.arch=llama", "model.num_experts=0", "model.shared_experts=0"])


# ------------------------------------------------------------------------------------------- FLOPs per token


def deepseek_active_by_hand(h=64, heads=4, qr=32, kvr=16, nope=16, rope=8, v=16, f=128, w=32, experts=8, k=2,
                            dense=1, layers=3, vocab=VOCAB) -> int:
    """The tiny DeepSeek-V3's parameters one token passes through, counted from its shape."""
    attention = (h * qr + qr + qr * heads * (nope + rope) + h * (kvr + rope) + kvr + kvr * heads * (nope + v)
                 + heads * v * h)
    moe = k * 3 * h * w + 3 * h * w + experts * h  # routed experts, the shared one, the router
    return layers * (attention + 2 * h) + dense * 3 * h * f + (layers - dense) * moe + 2 * vocab * h + h


def test_deepseek_v3_flops_count_latent_attention_at_its_head_widths():
    cfg, c, model = built(DEEPSEEK)
    counts = param_counts(model)
    assert counts["active"] == deepseek_active_by_hand()
    # QK^T at (16 + 8) per head, AV at 16 per head, 4 heads, 3 layers: 6 x 3 x 4 x (24 + 16) x S
    assert attention_width(c) == 3 * 4 * (24 + 16)
    got = flops_per_token(counts["active"], counts["lookup"], c.num_hidden_layers, c.hidden_size, SEQ, attention_width(c))
    assert got == 6 * (deepseek_active_by_hand() - VOCAB * 64) + 6 * 3 * 4 * 40 * SEQ
    assert got != flops_per_token(counts["active"], counts["lookup"], 3, 64, SEQ)  # hidden-wide heads would differ


def test_qwen3_5_moe_flops_count_only_the_full_attention_layers():
    cfg, c, model = built(QWEN)
    counts = param_counts(model)
    assert attention_width(c) == 2 * (2 * 4 * 16)  # 2 of 4 layers full attention, q/k and v of 4 heads of 16
    got = flops_per_token(counts["active"], counts["lookup"], 4, 64, SEQ, attention_width(c))
    assert got == 6 * (counts["active"] - VOCAB * 64) + 6 * 2 * 2 * 4 * 16 * SEQ
    _, all_linear, _ = built(QWEN, ["model.full_attention_every=5"])
    assert attention_width(all_linear) == 0  # no S^2 term at all


def test_the_planner_counts_the_recipes_model_class():
    from lmrecipe.planning.shapes import shape_from_config

    for recipe in (DEEPSEEK, QWEN):
        cfg, c, model = built(recipe)
        counts = param_counts(model)
        planned = shape_from_config(cfg.model, VOCAB)
        assert (planned.n_params, planned.n_active) == (counts["total"], counts["active"])
        assert planned.flops_per_token(SEQ) == flops_per_token(counts["active"], counts["lookup"], c.num_hidden_layers,
                                                               c.hidden_size, SEQ, attention_width(c))
        assert planned.memory_shape() == model_shape(c)


# ------------------------------------------------------------------------------------ the estimator's activations


def test_the_estimator_counts_a_latent_attention_layer_as_measured():
    """A dense DeepSeek-V3 layer (every layer dense: the MoE block's tensors depend on the routing) of other widths
    than the ones memory.attention_sizes was read from: its saved bytes as the estimate's, within 2 %. Its q/k heads
    are as wide as its v heads: unequal ones take SDPA's math kernel on a CPU (memory.attention_sizes)."""
    from transformers import AutoConfig

    tokens = 128
    kw = dict(hidden_size=160, num_attention_heads=5, intermediate_size=288, vocab_size=64, n_routed_experts=4,
              num_experts_per_tok=2, moe_intermediate_size=32, q_lora_rank=48, kv_lora_rank=40, qk_nope_head_dim=20,
              qk_rope_head_dim=12, v_head_dim=32, n_group=2, topk_group=1, use_cache=False)
    one, two = (AutoConfig.for_model("deepseek_v3", num_hidden_layers=n, first_k_dense_replace=n, **kw) for n in (1, 2))
    measured = saved_bytes(two, tokens) - saved_bytes(one, tokens)
    shape = replace(model_shape(two), mlp_size=288)  # its layers' MLP is the dense one
    a, _ = estimate_activations(shape, 1, tokens, "fp32")
    b, _ = estimate_activations(replace(shape, num_layers=3), 1, tokens, "fp32")
    assert b - a == pytest.approx(measured, rel=0.02)
    hidden_wide = replace(shape, attention_size=0, attention_out_size=0)  # a Llama layer's q, k, v at hidden_size
    c, _ = estimate_activations(replace(hidden_wide, num_layers=3), 1, tokens, "fp32")
    assert abs((c - estimate_activations(hidden_wide, 1, tokens, "fp32")[0]) - measured) > 0.1 * measured


def test_the_estimator_counts_linear_attention_layers_without_an_s2_term():
    """Qwen3.5-MoE: a linear-attention layer against a full-attention one (same MoE block), measured at other widths
    than memory.attention_sizes was read from, within 2 %; under eager attention only the full layers grow with S^2."""
    from transformers import AutoConfig

    tokens = 128
    kw = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=48, vocab_size=64, num_experts=4,
              num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
              linear_key_head_dim=24, linear_value_head_dim=40, linear_num_key_heads=2, linear_num_value_heads=6,
              use_cache=False)

    def layer(kind):
        configs = [AutoConfig.for_model("qwen3_5_moe_text", num_hidden_layers=n, layer_types=[kind] * n, **kw)
                   for n in (1, 2)]
        return saved_bytes(configs[1], tokens) - saved_bytes(configs[0], tokens), model_shape(configs[1])

    (full, full_shape), (linear, linear_shape) = layer("full_attention"), layer("linear_attention")
    assert linear_shape.linear_attention_layers == 2 and full_shape.linear_attention_layers == 0
    est_full = estimate_activations(full_shape, 1, tokens, "fp32")[0]
    est_linear = estimate_activations(linear_shape, 1, tokens, "fp32")[0]
    assert (est_linear - est_full) / 2 == pytest.approx(linear - full, rel=0.02)
    eager = [estimate_activations(s, 1, tokens, "fp32", attn_implementation="eager")[0] for s in (full_shape,
                                                                                                   linear_shape)]
    assert eager[1] == est_linear and eager[0] > est_full


def test_the_model_card_names_deepseek_v3s_shared_expert_width():
    from lmrecipe.export import _mlp_shape

    _, c, _ = built(DEEPSEEK)
    assert _mlp_shape(c.to_dict(), "deepseek_v3") == ("MoE MLP: 8 experts of width 32, each token routed to the top 2, "
                                                      "and a shared expert of width 32")
