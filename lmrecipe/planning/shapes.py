"""The Llama family the planner picks shapes from: depth = width / 128 (as Llama 3.2 1B 2048/16, Llama 3 8B 4096/32
and 405B 16384/126), MLP 3.5 x width (as Llama 3 8B and 70B), 64-wide heads up to width 2048, else 128, at most 8
key/value heads; :func:`shapes_near` a parameter count, and a recipe's own shape."""

from __future__ import annotations

import math
from dataclasses import dataclass

from lmrecipe.config import ModelConfig
from lmrecipe.planning.memory import ModelShape, model_shape
from lmrecipe.model.build import attention_width, build_hf_config, flops_per_token


@dataclass(frozen=True)
class LlamaShape:
    """A Llama decoder's sizes (no biases; RMSNorm; SwiGLU MLP), or with ``num_experts`` > 0 an MoE decoder whose every
    MLP is ``num_experts`` SwiGLU experts of width ``expert_size`` and a router, ``experts_per_token`` per token."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    tie_embeddings: bool
    num_experts: int = 0
    experts_per_token: int = 0
    expert_size: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def layer_params(self, active: bool = False) -> int:
        """One block's parameters (``active``: those one token passes through: its experts only)."""
        h, kv, f = self.hidden_size, self.num_kv_heads * self.head_dim, self.intermediate_size
        mlp = 3 * h * f
        if self.num_experts:
            mlp = (self.experts_per_token if active else self.num_experts) * 3 * h * self.expert_size + h * self.num_experts
        return h * (h + 2 * kv) + h * h + mlp + 2 * h

    @property
    def n_params(self) -> int:
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_embeddings else 2)
        return self.num_layers * self.layer_params() + embeddings + self.hidden_size

    @property
    def n_active(self) -> int:
        """Parameters one token passes through (``n_params`` for a dense shape)."""
        return self.n_params - self.num_layers * (self.layer_params() - self.layer_params(active=True))

    @property
    def n_lookup(self) -> int:
        """Parameters used only as a lookup: the input embedding, unless tied to the output projection."""
        return 0 if self.tie_embeddings else self.vocab_size * self.hidden_size

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token from the active parameters (:func:`lmrecipe.model.build.flops_per_token`)."""
        return flops_per_token(self.n_active, self.n_lookup, self.num_layers, self.hidden_size, seq_len)

    def memory_shape(self) -> ModelShape:
        """What :func:`lmrecipe.planning.memory.estimate` needs, counted without building the model."""
        h, kv, f, v = self.hidden_size, self.num_kv_heads * self.head_dim, self.intermediate_size, self.vocab_size
        if self.num_experts:
            return self._moe_memory_shape()
        per_layer = (h * h, h * kv, h * kv, h * h, f * h, f * h, h * f, h, h)  # q k v o, gate up down, two norms
        sizes = (v * h, *per_layer * self.num_layers, h, *(() if self.tie_embeddings else (v * h,)))
        return ModelShape(n_params=self.n_params, largest_layer_params=max(v * h, f * h), param_sizes=sizes,
                          num_layers=self.num_layers, hidden_size=h, kv_size=kv, mlp_size=f,
                          num_heads=self.num_heads, vocab_size=v,
                          muon_params=self.num_layers * (2 * h * h + 2 * h * kv + 3 * h * f),
                          tp_split_params=self.num_layers * (2 * h * h + 2 * h * kv + 3 * h * f)
                          + (0 if self.tie_embeddings else v * h))

    def _moe_memory_shape(self) -> ModelShape:
        """:meth:`memory_shape` of an MoE shape: each layer's experts as the class's two fused weights."""
        h, kv, v, e, n = self.hidden_size, self.num_kv_heads * self.head_dim, self.vocab_size, self.expert_size, \
            self.num_experts
        per_layer = (h * h, h * kv, h * kv, h * h, n * 2 * e * h, n * h * e, n * h, h, h)  # ..., experts, router, norms
        sizes = (v * h, *per_layer * self.num_layers, h, *(() if self.tie_embeddings else (v * h,)))
        return ModelShape(n_params=self.n_params, largest_layer_params=max(v * h, 3 * n * e * h), param_sizes=sizes,
                          num_layers=self.num_layers, hidden_size=h, kv_size=kv, mlp_size=self.experts_per_token * e,
                          num_heads=self.num_heads, vocab_size=v, expert_params=self.num_layers * 3 * n * e * h,
                          active_params=self.n_active)

    def overrides(self) -> list[str]:
        """The recipe's ``model.*`` keys for this shape."""
        return [f"model.hidden_size={self.hidden_size}", f"model.num_layers={self.num_layers}",
                f"model.num_heads={self.num_heads}", f"model.num_kv_heads={self.num_kv_heads}",
                f"model.intermediate_size={self.intermediate_size}", f"model.tie_embeddings={str(self.tie_embeddings).lower()}"]

    def describe(self) -> str:
        mlp = (f"{self.num_experts} experts of {self.expert_size} ({self.experts_per_token} per token, "
               f"{self.n_active / 1e9:.2f}B active)" if self.num_experts else f"MLP {self.intermediate_size}")
        return (f"{self.num_layers} x {self.hidden_size}, {self.num_heads} heads ({self.num_kv_heads} kv), "
                f"{mlp}{', tied' if self.tie_embeddings else ''}")


def _round_up(value: float, multiple: int) -> int:
    return int(-(-value // multiple) * multiple)


def family_shape(hidden_size: int, vocab_size: int) -> LlamaShape:
    """The family's shape of width ``hidden_size`` (module docstring): a multiple of 64."""
    head_dim = 64 if hidden_size <= 2048 else 128
    heads = hidden_size // head_dim
    mlp = _round_up(3.5 * hidden_size, 64 if hidden_size < 1024 else 256)
    return LlamaShape(hidden_size=hidden_size, num_layers=max(2, round(hidden_size / 128)), num_heads=heads,
                      num_kv_heads=math.gcd(heads, 8), intermediate_size=mlp, vocab_size=vocab_size,
                      tie_embeddings=hidden_size <= 3072)


def family_widths() -> list[int]:
    """Widths whose head count takes 8 (or 4) key/value heads evenly above 1,024."""
    return [*range(128, 1024, 64), *range(1024, 2048, 256), *range(2048, 32769, 512)]


def shapes_near(n_params: float, vocab_size: int, count: int = 3) -> list[LlamaShape]:
    """``count`` family shapes around ``n_params``, smallest first: the nearest (in log size) and its neighbours in
    the family, one smaller and one larger (at the family's ends, the next ones on the other side)."""
    family = [family_shape(h, vocab_size) for h in family_widths()]
    nearest = min(range(len(family)), key=lambda k: abs(math.log(family[k].n_params / n_params)))
    start = min(max(0, nearest - (count - 1) // 2), max(0, len(family) - count))
    return family[start:start + count]


@dataclass(frozen=True)
class ClassShape:
    """A recipe's model counted from its model class (built on the meta device): DeepSeek-V3's latent attention,
    dense first layers and shared expert, and Qwen3.5-MoE's linear-attention layers, which a Llama shape cannot
    describe. The planner reads it as a :class:`LlamaShape`."""

    arch: str
    hidden_size: int
    num_layers: int
    vocab_size: int
    n_params: int
    n_active: int
    n_lookup: int
    attention_width: int
    """:func:`lmrecipe.model.build.attention_width` of the model."""
    memory: ModelShape

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token from the active parameters and the real attention widths."""
        return flops_per_token(self.n_active, self.n_lookup, self.num_layers, self.hidden_size, seq_len,
                               self.attention_width)

    def memory_shape(self) -> ModelShape:
        return self.memory

    def overrides(self) -> list[str]:
        """None: the shape is the recipe's own."""
        return []

    def describe(self) -> str:
        return (f"{self.arch} {self.num_layers} x {self.hidden_size}, {self.n_active / 1e9:.2f}B active "
                "(the recipe's own model class)")


CLASS_SHAPE_ARCHS = ("deepseek_v3", "qwen3_5_moe_text")
"""The architectures the planner counts from their model class (:class:`ClassShape`)."""


def class_shape(m: ModelConfig, vocab_size: int) -> ClassShape:
    """The recipe's model of a :data:`CLASS_SHAPE_ARCHS` architecture, counted from its class."""
    hf_config = build_hf_config(m, vocab_size, m.max_position_embeddings or 4096)
    memory = model_shape(hf_config)
    return ClassShape(arch=m.arch, hidden_size=m.hidden_size, num_layers=m.num_layers, vocab_size=vocab_size,
                      n_params=memory.n_params, n_active=memory.active(),
                      n_lookup=0 if m.tie_embeddings else vocab_size * m.hidden_size,
                      attention_width=attention_width(hf_config), memory=memory)


def shape_from_config(m: ModelConfig, vocab_size: int) -> LlamaShape | ClassShape:
    """The recipe's own model (its ``model`` section) as a Llama shape, or counted from its class for DeepSeek-V3 and
    Qwen3.5-MoE (:class:`ClassShape`)."""
    if m.arch in CLASS_SHAPE_ARCHS and m.init_from is None:
        return class_shape(m, vocab_size)
    return LlamaShape(hidden_size=m.hidden_size, num_layers=m.num_layers, num_heads=m.num_heads, num_kv_heads=m.kv_heads(),
                      intermediate_size=m.mlp_size(), vocab_size=vocab_size, tie_embeddings=m.tie_embeddings,
                      num_experts=m.num_experts, experts_per_token=m.experts_per_token if m.is_moe() else 0,
                      expert_size=m.expert_size() if m.is_moe() else 0)
