"""The ``model`` section: the architecture and its initialisation, or the checkpoint to continue from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, Optional

from lmrecipe.config.sections.common import FIXED_ON_RESUME, fixed, non_negative, positive
from lmrecipe.errors import fail

MOE_ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3", "qwen3_5_moe_text")
"""The mixture-of-experts architectures (``model.arch``) a recipe builds with ``model.num_experts`` > 0."""
SHARED_EXPERT_ARCHS = {"qwen2_moe": 1, "deepseek_v3": 1, "qwen3_5_moe_text": 1}
"""The MoE architectures with shared experts, and how many each layer has (the others have none)."""
ROUTING_BIAS_ARCHS = ("deepseek_v3",)
"""The MoE architectures whose router chooses experts with a per-expert routing bias (``e_score_correction_bias``),
which ``model.router_bias_update_rate`` moves."""

DEEPSEEK_V3_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                    "expert_groups", "expert_groups_per_token", "routed_scaling_factor", "dense_layers")
"""The ``model`` keys of DeepSeek-V3 alone (``model.arch=deepseek_v3``): latent attention and group-limited routing."""
# The keys whose 0 means something: queries projected directly, every layer with experts.
ZERO_ALLOWED = {"q_lora_rank": "for queries projected directly", "dense_layers": "for experts in every layer"}
QWEN3_5_MOE_KEYS = ("full_attention_every", "linear_key_heads", "linear_value_heads", "linear_key_head_dim",
                    "linear_value_head_dim")
"""The ``model`` keys of Qwen3.5-MoE alone (``model.arch=qwen3_5_moe_text``): its layer pattern and linear attention."""


@dataclass
class ModelConfig:
    arch: str = fixed("llama")
    """Hugging Face ``model_type`` for a model built from scratch (any ``AutoConfig`` architecture)."""
    init_from: Optional[str] = None
    """Local Hugging Face checkpoint folder to continue pretraining from; null builds from scratch."""
    hidden_size: int = fixed(256)
    """Width of the residual stream (features)."""
    num_layers: int = fixed(4)
    """Number of transformer blocks."""
    num_heads: int = fixed(4)
    """Attention heads (query heads)."""
    num_kv_heads: Optional[int] = fixed(None)
    """Key/value heads for grouped-query attention; null means equal to ``num_heads``."""
    intermediate_size: Optional[int] = fixed(None)
    """MLP hidden width (features); null means 8/3 of ``hidden_size`` rounded up to a multiple of 64."""
    vocab_size: Optional[int] = fixed(None)
    """Vocabulary size (tokens); null takes the data's ``meta.json`` vocab size."""
    vocab_beyond_data: bool = False
    """Accept a ``vocab_size`` above the data tokenizer's (rounded up to a multiple of 128): embedding rows that no
    token reaches, e.g. to measure a model of another tokenizer's shape on any prepared data (the GPU kit does).
    Off, such a run is refused at start-up: the model was sized for another tokenizer."""
    max_position_embeddings: Optional[int] = fixed(None)
    """Longest position the model supports (tokens); null means ``data.seq_len``."""
    rope_theta: float = fixed(10000.0)
    """RoPE base frequency."""
    tie_embeddings: bool = fixed(False)
    """Share the input embedding and the output projection."""
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2", "flash_attention_3", "varlen",
                                 "flex_attention"] = "sdpa"
    """Attention kernel: sdpa (any device), eager, a flash kernel on a CUDA GPU where its package is installed
    (flash_attention_2: flash-attn; flash_attention_3: flash-attn-3, Hopper GPUs), varlen (needs document masking:
    per document, torch's flash variable-length kernel on CUDA in bf16/fp16, a per-document SDPA stand-in
    elsewhere) or flex_attention (CUDA: no FlexAttention backward on a CPU). Checked at start-up."""
    kernels: Literal["auto", "none", "liger"] = "auto"
    """Fused kernels for the elementwise work: none = transformers' own modules; liger = Liger-Kernel's Triton
    RMSNorm, SwiGLU and rotary kernels patched into the built model (a CUDA GPU, Triton and the liger-kernel package,
    ``pip install 'lmrecipe[liger]'``; refused at start-up where it cannot run); auto = liger where it can run and
    Liger has kernels for the architecture of a dense model, else none (logged, and in ``run_meta.json``)."""
    init_std: float = 0.02
    """Standard deviation of the normal weight initialisation."""
    extra: dict = field(default_factory=dict, metadata=FIXED_ON_RESUME)
    """Further keyword arguments for the architecture's ``AutoConfig`` (e.g. ``rms_norm_eps``)."""
    num_experts: int = fixed(0)
    """Routed experts in each mixture-of-experts layer (``model.arch`` qwen3_moe, qwen2_moe, mixtral, deepseek_v3 or
    qwen3_5_moe_text, ``docs/moe.md``); 0 = a dense model (any other architecture)."""
    experts_per_token: int = fixed(2)
    """Experts each token is routed to (top-k) in an MoE layer."""
    expert_intermediate_size: Optional[int] = fixed(None)
    """Hidden width of one expert's MLP (features); null means ``intermediate_size``'s value."""
    shared_experts: int = fixed(0)
    """Experts every token passes through besides its routed ones, of width ``expert_intermediate_size``: qwen2_moe,
    deepseek_v3 and qwen3_5_moe_text have 1 (set it), qwen3_moe and mixtral have none (0)."""
    router_aux_loss_coef: float = 0.001
    """Coefficient of the router's load-balancing loss (Switch Transformer's, as the model class computes it), added
    to the training objective and logged as ``aux_loss`` apart from ``loss``; validation, perplexity and
    ``eval.py`` report the language-model loss alone. 0 = off."""
    router_bias_update_rate: float = 0.0
    """Auxiliary-loss-free load balancing (DeepSeek-V3's, ``docs/moe.md``): after each optimizer step, every MoE
    layer's routing bias (``e_score_correction_bias``, which only chooses experts) moves by this much per expert,
    up for an expert that received fewer tokens than the mean over the step (all ranks) and down for one that
    received more. DeepSeek-V3 trained with 0.001. 0 = off; only for an architecture with a routing bias
    (``model.arch`` deepseek_v3)."""

    # DeepSeek-V3 (model.arch=deepseek_v3): multi-head latent attention and group-limited routing. null: the class's
    # default (DeepSeek-V3's published value).
    q_lora_rank: Optional[int] = fixed(None)
    """DeepSeek-V3: rank of the queries' low-rank projection (features); 0 projects the queries directly (no
    compression); null: 1536."""
    kv_lora_rank: Optional[int] = fixed(None)
    """DeepSeek-V3: rank of the compressed key/value latent every head's keys and values are expanded from
    (features); null: 512."""
    qk_nope_head_dim: Optional[int] = fixed(None)
    """DeepSeek-V3: per-head query/key width without rotary embedding (features); null: 128."""
    qk_rope_head_dim: Optional[int] = fixed(None)
    """DeepSeek-V3: per-head query/key width that carries the rotary embedding (features; the key's part is shared
    by all heads); null: 64."""
    v_head_dim: Optional[int] = fixed(None)
    """DeepSeek-V3: per-head value width (features); null: 128."""
    expert_groups: Optional[int] = fixed(None)
    """DeepSeek-V3: groups the routed experts are split into (``n_group``); must divide ``num_experts``; null: 8."""
    expert_groups_per_token: Optional[int] = fixed(None)
    """DeepSeek-V3: groups a token's experts are chosen within (``topk_group``, the best groups by their top-2
    scores); null: 4."""
    routed_scaling_factor: Optional[float] = fixed(None)
    """DeepSeek-V3: factor on the routed experts' combined output (their sigmoid weights); null: 2.5."""
    dense_layers: Optional[int] = fixed(None)
    """DeepSeek-V3: the first layers, whose MLP is dense (width ``intermediate_size``) instead of experts
    (``first_k_dense_replace``; 0: every layer has experts); null: 3."""
    # Qwen3.5-MoE (model.arch=qwen3_5_moe_text): gated DeltaNet linear attention between gated full attention.
    full_attention_every: Optional[int] = fixed(None)
    """Qwen3.5-MoE: every this-many-th layer has full attention, the others gated DeltaNet linear attention (layer
    i is full attention when (i + 1) is a multiple); 1: every layer full attention; null: 4."""
    linear_key_heads: Optional[int] = fixed(None)
    """Qwen3.5-MoE: key (and query) heads of a linear-attention layer; null: 16."""
    linear_value_heads: Optional[int] = fixed(None)
    """Qwen3.5-MoE: value heads of a linear-attention layer (a multiple of ``linear_key_heads``); null: 32."""
    linear_key_head_dim: Optional[int] = fixed(None)
    """Qwen3.5-MoE: width of one linear-attention key/query head (features); null: 128."""
    linear_value_head_dim: Optional[int] = fixed(None)
    """Qwen3.5-MoE: width of one linear-attention value head (features; the recurrent state per value head is
    ``linear_key_head_dim`` x this); null: 128."""

    def validate(self) -> None:
        positive(self, "hidden_size", "num_layers", "num_heads")
        kv = self.kv_heads()
        if kv <= 0:
            raise fail(f"model.num_kv_heads={kv} must be a positive divisor of model.num_heads={self.num_heads}.")
        for key in ("intermediate_size", "vocab_size", "max_position_embeddings"):
            value = getattr(self, key)
            if value is not None and value <= 0:
                raise fail(f"model.{key}={value} must be positive (or null for the default).")
        non_negative(self, "num_experts", "shared_experts")
        if not math.isfinite(self.router_aux_loss_coef) or self.router_aux_loss_coef < 0:
            raise fail(f"model.router_aux_loss_coef={self.router_aux_loss_coef} must be a finite number >= 0 "
                       "(0.001 is Qwen's and Mixtral's value; 0 turns the router's auxiliary loss off).")
        if not math.isfinite(self.router_bias_update_rate) or self.router_bias_update_rate < 0:
            raise fail(f"model.router_bias_update_rate={self.router_bias_update_rate} must be a finite number >= 0 "
                       "(0.001 is DeepSeek-V3's value; 0 leaves the routing bias as it is).")
        if self.router_bias_update_rate and self.init_from is None and self.arch not in ROUTING_BIAS_ARCHS:
            raise fail(f"model.router_bias_update_rate={self.router_bias_update_rate} moves a router's routing bias "
                       f"(auxiliary-loss-free balancing), and model.arch={self.arch}'s router has none: only "
                       f"{', '.join(ROUTING_BIAS_ARCHS)} routes with one. Set model.router_bias_update_rate=0 (and "
                       "balance with model.router_aux_loss_coef), or choose model.arch=deepseek_v3.")
        if self.num_experts and not 1 <= self.experts_per_token <= self.num_experts:
            raise fail(f"model.experts_per_token={self.experts_per_token} must be in [1, model.num_experts="
                       f"{self.num_experts}] (each token's routed experts are chosen among them).")
        self.validate_architecture_keys()
        if self.expert_intermediate_size is not None and self.expert_intermediate_size <= 0:
            raise fail(f"model.expert_intermediate_size={self.expert_intermediate_size} must be positive (or null "
                       "for model.intermediate_size).")

    def validate_architecture_keys(self) -> None:
        """The DeepSeek-V3 and Qwen3.5-MoE keys, each on its own: positive where set (``q_lora_rank`` and ``dense_layers`` may be 0).
        Whether they fit the architecture and each other is ``lmrecipe/config/rules.py``'s."""
        for key in (*DEEPSEEK_V3_KEYS, *QWEN3_5_MOE_KEYS):
            value = getattr(self, key)
            if value is None or (key in ZERO_ALLOWED and value == 0):
                continue
            if not math.isfinite(value) or value <= 0:
                zero = f" (or 0 {ZERO_ALLOWED[key]})" if key in ZERO_ALLOWED else ""
                raise fail(f"model.{key}={value} must be positive{zero}, or null for the architecture's default.")

    def kv_heads(self) -> int:
        return self.num_kv_heads if self.num_kv_heads is not None else self.num_heads

    def mlp_size(self) -> int:
        if self.intermediate_size is not None:
            return self.intermediate_size
        return -(-(8 * self.hidden_size // 3) // 64) * 64

    def is_moe(self) -> bool:
        """Whether the model has mixture-of-experts layers (``num_experts`` > 0)."""
        return self.num_experts > 0

    def expert_size(self) -> int:
        """Hidden width of one expert's MLP (features)."""
        return self.expert_intermediate_size if self.expert_intermediate_size is not None else self.mlp_size()
