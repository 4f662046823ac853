"""Memory per rank: model-state bytes measured from the tensors a rank holds, and the ZeRO estimate.

Model states are the weights, the gradients and the optimizer states (the fp32 master copy counts as an
optimizer state, as in the ZeRO paper). Both halves of this module use the same three buckets, so
``tools/compare_zero.py`` can put a measurement next to its estimate.

Estimate (:func:`estimate`): bytes per parameter of each state, held whole by every rank or divided over
the N data-parallel ranks, are in ``_BYTES_PER_PARAM``. The 16-bit rows (DeepSpeed bf16/fp16) start from the
ZeRO paper's 2 + 2 + 12 = 16 bytes (Rajbhandari et al. 2020, sec. 3.1), sharded per stage, with the additions
DeepSpeed's own estimators make, so they can be checked against them (``estimate_zero2_model_states_mem_needs``,
``estimate_zero3_model_states_mem_needs``): a 4-byte fp32 gradient partition for the update at stages 1-2, and
at stage 3 the gradient counted once, as that fp32 partition. The fp32 rows are what DeepSpeed 0.19.8 holds in
fp32 training, as measured by compare_zero. Per rank, at 16-bit (fp32 in brackets, where it differs)::

                     weights          gradients                 optimizer (fp32 master + Adam m, v)
    stage 0 (DDP)    4                4                         8
    stage 1, 2       2 [4]            (2 + 4)/N [4/N]           (4 + 8)/N
    stage 3          2/N [4/N]        4/N                       (4 + 8)/N

* Stage 1 reduces gradients only at the accumulation boundary, so with accumulation every rank holds the
  whole gradient (w bytes) until then; without accumulation DeepSpeed reduces bucket by bucket and keeps
  only its partition, like stage 2.
* Stage 3 keeps parameters with at most ``stage3_param_persistence_threshold`` elements whole on every
  rank ("persistent"), besides their partition; and while a layer runs it gathers that layer's weights and
  gradients (``gathered``: 2 x w x the largest layer's parameters, as DeepSpeed's estimator counts it).
* Offload moves the optimizer states and the fp32 gradient partitions to CPU memory (``offload_optimizer``;
  fp32 ZeRO-3 keeps two of them there), and the stage-3 weight partition too (``offload_param``).
* Muon (``optim.name=muon``) keeps one fp32 moment for the hidden matrices (``ModelShape.muon_params``) instead
  of Adam's two: 4 bytes fewer per such parameter. fp8 training (``train.precision=fp8``) counts as bf16: its
  float8 copies of a layer's input and weight exist only inside the layer's matmuls.

Measured (:func:`model_state_bytes`): the distinct bytes of memory covered by

* weights: every model parameter's data, and under ZeRO-3 its partition (``param.ds_tensor``);
* gradients: ``.grad`` (and DeepSpeed's ``grad_accum``) of the model parameters and of the master partitions,
  and DeepSpeed's reduced gradient partitions (``averaged_gradients``, ZeRO-3's ``grad_partitions_flat_buffer``);
* optimizer: DeepSpeed's fp32 master partitions and every tensor in the optimizer's ``state``.

A tensor that is a view into a larger flat buffer counts only the bytes it covers, and memory already
counted in an earlier bucket (e.g. a master partition that is the weight partition) is not counted again.
Under offload these tensors live in CPU memory; they are counted all the same and reported per device.
Not counted: communication buckets (DDP's reducer buckets, DeepSpeed's ``reduce_bucket_size`` buffers),
offload staging buffers, activations, and the transient copies made inside the update itself.

Activations, per micro-batch of b sequences of s tokens, e bytes per activation element (2 under bf16/fp16,
else 4), per decoder layer of width h, key/value width h_kv, MLP width f and a heads, the tensors a Llama-style
layer saves for its backward pass (no dropout)::

    e * b * s * (6h + 2h_kv + 4f + h)          sdpa / flash attention (the kernel saves its output)
    e * b * s * (6h + 2h_kv + 4f + a * s)      eager attention (softmax probabilities)

(DeepSeek-V3's latent attention and Qwen3.5-MoE's gated attention save other tensors than 2h + 2h_kv + h:
``ModelShape.attention_size`` and ``attention_out_size``, :func:`attention_sizes`; Qwen3.5-MoE's linear-attention
layers save ``linear_attention_size`` fp32 elements per token instead, with no a * s term under any kernel)

(inputs of the two norms and of the q/k/v, output and MLP projections, rotated q and k, v, gate, up,
SiLU(gate) and their product), the same terms as Korthikanti et al. 2022, eq. 2, without
dropout masks and with the MLP of this architecture. The output layer adds b * s * (2h e + V (e + 8)) (final
norm and head inputs; logits, the fp32 log-probabilities the loss keeps for its backward, and their fp32 gradient
while it forms: three logits-sized tensors at the peak, as ``bench/run.py long_context`` measures). With the chunked
loss (``train.loss_chunk_tokens`` = c) it keeps b * s * (2h e + 4) (the inputs and each token's log-sum-exp) and
one chunk of fp32 logits at a time, min(c, b * s) * V * 4 (computed in place), plus below fp32 the chunk's copy in
the model's dtype (min(c, b * s) * V * e). Both paths count the output weight's gradient, which forms at that peak
(e V h; the chunked loss sums it in an fp32 buffer, 4 V h), before any earlier layer's gradient exists. With activation checkpointing each layer keeps only its input (e * b * s * h) and one layer's activations
exist again while it is recomputed. The peak is either in the output layer's backward (the output term) or in a
decoder layer's, whose gradients of the MLP's gate and up outputs (2 e * b * s * f) exist besides the saved
tensors; the larger of the two counts. Under sequence parallelism (``distributed.sequence_parallel_size`` = p) a rank
holds s / p tokens of every window: every per-token term above divides by p (inside attention the all-to-all trades
the sequence split for a head split, so the kernel's inputs and output are the same size), plus the exchanged
q, k, v, which are kept besides the rank's own (e * b * s / p * (h + 2 h_kv)); the model states still divide over
all ranks.

Under tensor parallelism (``distributed.tensor_parallel_size`` = t, DeepSpeed AutoTP) each rank holds 1/t of every
linear layer's matrix (``ModelShape.tp_split_params``: attention, MLP and output projections) and the rest whole
(embeddings, norms); ZeRO then divides those per-rank states over the t-times fewer data-parallel ranks. Of a
layer's saved activations, the tensors between a column- and a row-parallel matmul divide by t (the output
projection's input, rotated q and k, v, the attention output and log-sum-exp, gate, up, SiLU(gate) and their
product); the norms' inputs and the projections' common inputs stay whole, as do the logits (the output layer
gathers them for the loss).
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from torch import nn

from lmrecipe.config import Workload
from lmrecipe.model.build import param_counts
from lmrecipe.optim import expert_params, muon_split
from lmrecipe.parallel.topology import Topology, ZeroSetup

logger = logging.getLogger(__name__)

BUCKETS = ("weights", "gradients", "optimizer")
# DeepSpeed 0.19 ZeRO optimizer attributes that hold each kind of model state.
_ZERO_MASTER_ATTRS = ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat")
_ZERO_GRAD_ATTRS = ("averaged_gradients", "grad_partitions_flat_buffer")


# --------------------------------------------------------------------------------------------------
# Measurement


def _tensors(obj):
    """Tensors in a tensor or nested lists / tuples / dicts of them."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item)


def _span(tensor: torch.Tensor) -> tuple[str, int, int] | None:
    """(device, first byte, end byte) of the memory a tensor's elements cover; None for an empty tensor."""
    if tensor.numel() == 0 or tensor.device.type == "meta":
        return None
    elements = 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    start = tensor.data_ptr()
    return str(tensor.device), start, start + elements * tensor.element_size()


def _union_bytes(spans: list[tuple[str, int, int]]) -> dict[str, int]:
    """Bytes per device covered by the union of the spans (overlapping views count once)."""
    totals: dict[str, int] = {}
    for device in {s[0] for s in spans}:
        covered, end = 0, -1
        for _, lo, hi in sorted(s for s in spans if s[0] == device):
            if hi <= end:
                continue
            covered += hi - max(lo, end)
            end = hi
        totals[device] = covered
    return totals


def _optimizer_chain(optimizer) -> list:
    """The optimizer and everything it wraps (Accelerate wrapper -> DeepSpeed ZeRO optimizer -> torch optimizer)."""
    chain = []
    while optimizer is not None and all(optimizer is not o for o in chain):
        chain.append(optimizer)
        optimizer = getattr(optimizer, "optimizer", None)
    return chain


def model_state_bytes(model: nn.Module, optimizer) -> dict:
    """Bytes of weights, gradients and optimizer states this rank holds now, measured from the tensors.

    Returns ``{"weights": B, "gradients": B, "optimizer": B, "total": B, "by_device": {device: B}}``.
    See the module docstring for what is counted.
    """
    chain = _optimizer_chain(optimizer)
    base = chain[-1]
    zero = next((o for o in chain if any(hasattr(o, a) for a in _ZERO_MASTER_ATTRS)), None)
    params = list(model.parameters())
    masters = [t for a in _ZERO_MASTER_ATTRS for t in _tensors(getattr(zero, a, None))] if zero is not None else []

    found: dict[str, list[torch.Tensor]] = {bucket: [] for bucket in BUCKETS}
    for p in params:
        found["weights"] += [p, *_tensors(getattr(p, "ds_tensor", None))]
        found["gradients"] += [*_tensors(p.grad), *_tensors(getattr(p, "grad_accum", None))]
    found["gradients"] += [g for m in masters for g in _tensors(m.grad)]
    if zero is not None:
        found["gradients"] += [t for a in _ZERO_GRAD_ATTRS for t in _tensors(getattr(zero, a, None))]
    found["optimizer"] += masters + [t for state in base.state.values() for t in _tensors(state)]

    result: dict = {}
    spans: list[tuple[str, int, int]] = []
    counted = 0
    for bucket in BUCKETS:
        spans += [s for s in map(_span, found[bucket]) if s is not None]
        covered = sum(_union_bytes(spans).values())
        result[bucket] = covered - counted
        counted = covered
    result["total"] = counted
    result["by_device"] = _union_bytes(spans)
    return result


def read_measured(out_dir: str | os.PathLike) -> list[dict]:
    """The ``memory_rank*.json`` files of a run, by rank (empty if the run made fewer than two steps)."""
    files = sorted(Path(out_dir).glob("memory_rank*.json"), key=lambda p: int(p.stem.removeprefix("memory_rank")))
    return [json.loads(p.read_text()) for p in files]


# --------------------------------------------------------------------------------------------------
# Estimate


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs to know about a model."""

    n_params: int
    """Parameters, tied weights counted once."""
    largest_layer_params: int
    """Most parameters owned directly by one module (DeepSpeed's ``largest_layer_params``)."""
    param_sizes: tuple[int, ...]
    """Elements of every distinct parameter (for ZeRO-3's persistence threshold)."""
    num_layers: int
    hidden_size: int
    kv_size: int
    """Width of the keys (= of the values): kv heads x head size."""
    mlp_size: int
    num_heads: int
    vocab_size: int
    muon_params: int = 0
    """Elements of the hidden 2-D matrices, which ``optim.name=muon`` trains with Muon (one moment, not two)."""
    tp_split_params: int = 0
    """Elements of the linear layers' weights, which tensor parallelism (AutoTP) splits over its ranks."""
    expert_params: int = 0
    """Elements of the routed experts' weights (an MoE model), which expert parallelism (AutoEP) splits over its
    ranks; 0 for a dense model."""
    active_params: int = 0
    """Parameters one token passes through (the routed experts counted ``experts_per_token`` of ``num_experts``);
    0 means all of ``n_params`` (a dense model)."""
    attention_size: int = 0
    """Elements per token one softmax-attention layer saves between its input and its output projection, the
    kernel's output apart (:func:`attention_sizes`); 0: a Llama layer's 2 hidden_size + 2 kv_size."""
    attention_out_size: int = 0
    """Width of the attention kernel's output (heads x value width); 0: hidden_size."""
    linear_attention_layers: int = 0
    """Layers whose attention is linear (Qwen3.5-MoE's gated DeltaNet): no S^2 term, no softmax kernel."""
    linear_attention_size: int = 0
    """fp32 elements per token one linear-attention layer saves instead (:func:`attention_sizes`)."""

    def active(self) -> int:
        """Parameters one token passes through (all of them for a dense model)."""
        return self.active_params or self.n_params

    def split_experts(self, ep: int) -> tuple["ModelShape", "ModelShape"]:
        """The parameters outside the routed experts, and one of ``ep`` expert-parallel ranks' share of the experts:
        ZeRO partitions the first over every data-parallel rank and the second over ``world_size / ep`` ranks."""
        dense = replace(self, n_params=self.n_params - self.expert_params, expert_params=0,
                        muon_params=max(0, self.muon_params - self.expert_params))
        experts = replace(self, n_params=self.expert_params // ep, expert_params=self.expert_params // ep,
                          largest_layer_params=-(-self.largest_layer_params // ep), param_sizes=(), muon_params=0)
        return dense, experts

    def per_tensor_parallel_rank(self, tp: int) -> "ModelShape":
        """The parameters one of ``tp`` tensor-parallel ranks holds: its share of the split matrices, the rest whole."""
        if tp == 1:
            return self
        held = self.n_params - self.tp_split_params + self.tp_split_params // tp
        return replace(self, n_params=held, largest_layer_params=-(-self.largest_layer_params // tp),
                       muon_params=self.muon_params // tp)

    def persistent_params(self, threshold: int) -> int:
        return sum(n for n in self.param_sizes if n <= threshold)


def model_shape(hf_config) -> ModelShape:
    """The shape of a transformers model built on the meta device (no weights are allocated)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    unique = {id(p): p.numel() for p in model.parameters()}
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    experts = sum(p.numel() for p in expert_params(model))
    mlp_size = getattr(hf_config, "intermediate_size", None) or 4 * hf_config.hidden_size
    if experts:  # a token passes through experts_per_token experts of their width
        mlp_size = hf_config.num_experts_per_tok * (getattr(hf_config, "moe_intermediate_size", None) or mlp_size)
        mlp_size += _shared_width(hf_config)
    return ModelShape(
        **attention_sizes(hf_config),
        n_params=sum(unique.values()),
        largest_layer_params=largest,
        param_sizes=tuple(unique.values()),
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        kv_size=(getattr(hf_config, "num_key_value_heads", None) or heads) * head_dim,
        mlp_size=mlp_size,
        num_heads=heads,
        vocab_size=hf_config.vocab_size,
        muon_params=sum(p.numel() for p in muon_split(model, False)[0]),
        tp_split_params=_linear_params(model),
        expert_params=experts,
        active_params=param_counts(model)["active"] if experts else 0,
    )


def _shared_width(hf_config) -> int:
    """The shared experts' width every token also passes through: DeepSeek-V3's and Qwen3.5-MoE's (the older
    architectures' estimates count the routed experts alone)."""
    kind = getattr(hf_config, "model_type", None)
    if kind == "deepseek_v3":
        return hf_config.n_shared_experts * hf_config.moe_intermediate_size
    if kind == "qwen3_5_moe_text":
        return hf_config.shared_expert_intermediate_size
    return 0


DELTANET_CHUNK = 64
"""Tokens per chunk of transformers' torch gated-DeltaNet (``torch_chunk_gated_delta_rule``)."""


def attention_sizes(hf_config) -> dict[str, int]:
    """The :class:`ModelShape` attention fields of the architectures whose attention is not a Llama layer's, measured
    with saved-tensor hooks on transformers 5.23 (``tests/unit/test_memory.py`` holds the measurements to 2 %).

    DeepSeek-V3's latent attention saves, per head, its q and k (qk_nope + qk_rope wide each), its v, the kernel's
    output and the output projection's input (v_head_dim wide each; the kernel's output is ``attention_out_size``)
    and the keys' part without rotary (qk_nope); once, the shared rotary key part (qk_rope), each latent three times
    (norm input, normalized, the up-projection's input) and one more hidden-wide tensor. With qk_nope + qk_rope
    unequal to v_head_dim, SDPA on a CPU takes its math kernel, which also keeps the S^2 probabilities (not counted:
    a GPU's efficient kernel takes unequal widths). Qwen3.5-MoE's gated full attention saves 7 x heads x head_dim
    (queries and their gate, normalized, rotated, the gated product and its factors) and 4 x kv heads x head_dim; its
    gated DeltaNet layers (the torch fallback, in fp32 whatever the precision) save 4 x key heads x key width before
    the keys are repeated to the value heads, 12.5 x value heads x key width, 11.5 x value heads x value width and 5
    chunk-sized tensors per value head (``DELTANET_CHUNK``), less 6."""
    kind = getattr(hf_config, "model_type", None)
    heads = hf_config.num_attention_heads
    if kind == "deepseek_v3":
        c = hf_config
        qk, v = heads * (c.qk_nope_head_dim + c.qk_rope_head_dim), heads * c.v_head_dim
        latent = 3 * (c.q_lora_rank or 0) + 3 * c.kv_lora_rank + c.qk_rope_head_dim + heads * c.qk_nope_head_dim
        return {"attention_size": 2 * qk + 2 * v + latent + c.hidden_size, "attention_out_size": v}
    if kind == "qwen3_5_moe_text":
        c = hf_config
        q, kv = heads * c.head_dim, c.num_key_value_heads * c.head_dim
        hk, hv = c.linear_num_key_heads, c.linear_num_value_heads
        linear = (4 * hk * c.linear_key_head_dim + 12.5 * hv * c.linear_key_head_dim
                  + 11.5 * hv * c.linear_value_head_dim + (5 * DELTANET_CHUNK - 6) * hv)
        layers = sum(1 for t in c.layer_types[:c.num_hidden_layers] if t == "linear_attention")
        return {"attention_size": 7 * q + 4 * kv, "attention_out_size": q, "linear_attention_layers": layers,
                "linear_attention_size": round(linear)}
    return {}


def _linear_params(model: nn.Module) -> int:
    """Elements of the distinct linear-layer weights, less one tied to the embedding (which stays whole)."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    linear = {id(m.weight): m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear)}
    return sum(n for key, n in linear.items() if key not in embeddings)


@dataclass
class MemoryEstimate:
    """Bytes per rank (``cpu_per_node``: per node) for one ZeRO setup."""

    weights: float
    gradients: float
    optimizer: float
    model_states: float
    """weights + gradients + optimizer, wherever they live."""
    model_states_device: float
    """The part of the model states in accelerator memory."""
    model_states_cpu: float
    """The part offloaded to CPU memory."""
    cpu_per_node: float
    """Offloaded bytes of all ranks of one node."""
    gathered: float
    """ZeRO-3: weights and gradients of the largest layer while it runs (device)."""
    activations: float
    """Saved activations of one micro-batch without activation checkpointing."""
    activations_checkpointed: float
    """The same with activation checkpointing."""
    device_total: float
    """model_states_device + gathered + ema + the activations of the recipe's checkpointing choice."""
    ema: float = 0.0
    """The weight EMA's fp32 shadow (``train.ema_decay`` > 0; device): 4 bytes per parameter, divided over the ranks
    under ZeRO-3."""

    def to_dict(self) -> dict:
        return asdict(self)


# Bytes per parameter of each model state as (held whole by every rank, divided over the N ranks).
# 16-bit rows: DeepSpeed's estimator accounting (its comments: "2 = params_16bit, 18 = 2_grads_16bit +
# 4_grads_32bit + 4_params_32bit + 8_optimizer_states_32bit" at ZeRO-2; 18 = 2 + 16 at ZeRO-3).
# fp32 rows: what DeepSpeed 0.19.8 holds, measured by compare_zero (its update keeps a separate fp32 master
# partition even when the weights are fp32). Stage 0 is DDP: Accelerate's autocast keeps fp32 weights.
_BYTES_PER_PARAM = {
    # (precision, stage): (weights, gradients, optimizer = fp32 master + Adam m, v)
    ("16-bit", 0): ((4, 0), (4, 0), (8, 0)),
    ("16-bit", 1): ((2, 0), (0, 2 + 4), (0, 12)),
    ("16-bit", 2): ((2, 0), (0, 2 + 4), (0, 12)),
    ("16-bit", 3): ((0, 2), (0, 4), (0, 12)),
    ("fp32", 0): ((4, 0), (4, 0), (8, 0)),
    ("fp32", 1): ((4, 0), (0, 4), (0, 12)),
    ("fp32", 2): ((4, 0), (0, 4), (0, 12)),
    ("fp32", 3): ((0, 4), (0, 4), (0, 12)),
}
# With offload_optimizer the gradients the rank keeps are fp32 partitions in CPU memory (16-bit gradients only
# stream through buckets). fp32 ZeRO-3 keeps two: its reduced partition and the CPU optimizer's copy.
_OFFLOADED_GRADIENTS = {("16-bit", 1): 4, ("16-bit", 2): 4, ("16-bit", 3): 4, ("fp32", 1): 4, ("fp32", 2): 4, ("fp32", 3): 8}


HALF_PRECISIONS = ("bf16", "fp16", "fp8")
"""Precisions whose weights, gradients and activations are 16-bit (fp8: bf16 everywhere but inside the float8
matmuls, whose float8 copies are transient)."""


def weight_bytes(precision: str, stage: int) -> int:
    """Bytes of a working weight: 16-bit under DeepSpeed mixed precision, else fp32 (autocast keeps fp32 weights)."""
    return 2 if stage > 0 and precision in HALF_PRECISIONS else 4


def estimate_model_states(
    shape: ModelShape, setup: ZeroSetup, world_size: int, gpus_per_node: int, precision: str, accum_steps: int,
    optimizer: str = "adamw",
) -> dict[str, float]:
    """Weights, gradients and optimizer bytes per rank, and where they live (see the module docstring).
    ``optimizer`` muon: Muon's matrices hold one fp32 moment instead of AdamW's two (4 bytes fewer each)."""
    n, p = world_size, shape.n_params
    kind = "16-bit" if precision in HALF_PRECISIONS else "fp32"
    (w_whole, w_part), (g_whole, g_part), (o_whole, o_part) = _BYTES_PER_PARAM[kind, setup.stage]
    if setup.stage == 1 and accum_steps > 1:
        # Stage 1 reduces only at the accumulation boundary: until then every rank holds the whole gradient
        # (its partition replaces it at the boundary; 16-bit still adds the fp32 partition for the update).
        g_whole, g_part = weight_bytes(precision, setup.stage), (4 if kind == "16-bit" else 0)
    if setup.offload_optimizer and setup.stage > 0:
        g_whole, g_part = 0, _OFFLOADED_GRADIENTS[kind, setup.stage]
    persistent = shape.persistent_params(setup.persistence_threshold) if setup.stage == 3 else 0
    weights = w_whole * p + w_part * p / n + w_part * persistent
    grads = g_whole * p + g_part * p / n
    optim = o_whole * p + o_part * p / n
    if optimizer == "muon":
        optim -= 4.0 * shape.muon_params / (n if o_part else 1)
    cpu_weights = w_part * p / n if setup.stage == 3 and setup.offload_param else 0.0
    if setup.offload_optimizer and setup.stage > 0:
        return _placed(weights, grads, optim, cpu_weights, grads, optim, gpus_per_node)
    return _placed(weights, grads, optim, cpu_weights, 0.0, 0.0, gpus_per_node)


def _placed(weights, grads, optim, cpu_weights, cpu_grads, cpu_optim, gpus_per_node) -> dict[str, float]:
    total = weights + grads + optim
    cpu = cpu_weights + cpu_grads + cpu_optim
    return {
        "weights": weights, "gradients": grads, "optimizer": optim, "model_states": total,
        "model_states_device": total - cpu, "model_states_cpu": cpu, "cpu_per_node": cpu * gpus_per_node,
    }


def output_layer_bytes(shape: ModelShape, tokens: int, precision: str, loss_chunk_tokens: int = 0) -> float:
    """Bytes of the output layer and the loss for ``tokens`` tokens: the logits path or the chunked loss."""
    e = 2 if precision in HALF_PRECISIONS else 4
    h, vocab = shape.hidden_size, shape.vocab_size
    if loss_chunk_tokens <= 0:
        return float(tokens * (2 * h * e + vocab * (e + 8)) + e * vocab * h)
    chunk = min(loss_chunk_tokens, tokens) * vocab * (4 + (e if e != 4 else 0))
    return float(tokens * (2 * h * e + 4) + chunk + 4 * vocab * h)


def layer_extras(shape: ModelShape, e: int) -> int:
    """Bytes per token per layer that transformers' Llama layer saves beyond the terms of Korthikanti et al. (measured
    with saved-tensor hooks, transformers 5.23): RMSNorm's normalized input before its weight (e h), below fp32 the
    norms' fp32 copies of their inputs (4 h), their fp32 reciprocal RMS (2 x 4) and the attention kernel's fp32
    log-sum-exp per head (4 a)."""
    return e * shape.hidden_size + (4 * shape.hidden_size if e < 4 else 0) + 8 + 4 * shape.num_heads


def estimate_activations(shape: ModelShape, micro_batch_size: int, seq_len: int, precision: str,
                         attn_implementation: str = "sdpa", loss_chunk_tokens: int = 0,
                         sequence_parallel_size: int = 1, tensor_parallel_size: int = 1) -> tuple[float, float]:
    """Saved-activation bytes of one micro-batch on one rank without and with activation checkpointing (module
    docstring); ``seq_len`` is the whole window's, of which a rank holds ``1 / sequence_parallel_size``; under
    tensor parallelism the tensors between the split matmuls divide by ``tensor_parallel_size``."""
    e = 2 if precision in HALF_PRECISIONS else 4
    h, kv, f, t = shape.hidden_size, shape.kv_size, shape.mlp_size, tensor_parallel_size
    tokens = micro_batch_size * seq_len // sequence_parallel_size
    whole = 4 * h  # inputs of the two norms, of q/k/v and of the MLP
    # output projection's input, rotated q and k, v (latent or gated attention: shape.attention_size); gate, up,
    # SiLU(gate), product
    split = (shape.attention_size or 2 * h + 2 * kv) + 4 * f
    extras = layer_extras(shape, e) - 4 * shape.num_heads + 4 * shape.num_heads / t  # the log-sum-exp is per head
    per_layer = tokens * (e * (whole + split / t) + extras)
    per_layer += (e * micro_batch_size * shape.num_heads / t * seq_len**2 if attn_implementation == "eager"
                  else e * tokens * (shape.attention_out_size or h) / t)
    if sequence_parallel_size > 1:  # the exchanged q, k, v are kept for the backward besides the rank's own
        per_layer += e * tokens * (h + 2 * kv)
    # A linear-attention layer: its recurrence's tensors (fp32) instead of the softmax attention's, no S^2 term.
    linear_layer = tokens * (e * (whole + 4 * f / t) + extras + 4 * shape.linear_attention_size / t)
    linear = shape.linear_attention_layers
    output = output_layer_bytes(shape, tokens, precision, loss_chunk_tokens)
    # While a layer's backward runs, the gradients of its MLP's gate and up outputs exist besides the saved tensors.
    working = 2 * e * tokens * f / t
    full = (shape.num_layers - linear) * per_layer + linear * linear_layer + max(output, working)
    checkpointed = (shape.num_layers * e * tokens * h + (max(per_layer, linear_layer) if linear else per_layer)
                    + max(output, working))
    return float(full), float(checkpointed)


def estimate(shape: ModelShape, setup: ZeroSetup, world_size: int, num_nodes: int, precision: str,
             accum_steps: int, micro_batch_size: int, seq_len: int, gradient_checkpointing: bool,
             attn_implementation: str = "sdpa", ema: bool = False, loss_chunk_tokens: int = 0,
             sequence_parallel_size: int = 1, optimizer: str = "adamw", tensor_parallel_size: int = 1,
             expert_parallel_size: int = 1) -> MemoryEstimate:
    """The per-rank memory budget of one ZeRO setup (``ema``: with a weight EMA; ``loss_chunk_tokens``: the chunked
    loss, 0 = full logits; ``sequence_parallel_size``: ranks sharing each window; ``optimizer``: ``optim.name``;
    ``tensor_parallel_size``: ranks splitting each matrix, whose states ZeRO divides over the data-parallel ranks;
    ``expert_parallel_size``: ranks splitting an MoE model's experts, whose states ZeRO divides over the
    ``world_size / expert_parallel_size`` ranks that hold the same experts)."""
    if world_size % num_nodes or world_size % tensor_parallel_size:
        raise ValueError(f"world_size={world_size} is not a multiple of num_nodes={num_nodes} and "
                         f"tensor_parallel_size={tensor_parallel_size}")
    activation_shape = shape
    shape = shape.per_tensor_parallel_rank(tensor_parallel_size)
    states = estimate_model_states(shape, setup, world_size // tensor_parallel_size, world_size // num_nodes,
                                   precision, accum_steps, optimizer)
    if expert_parallel_size > 1 and shape.expert_params:
        dense, experts = shape.split_experts(expert_parallel_size)
        apart = [estimate_model_states(dense, setup, world_size, world_size // num_nodes, precision, accum_steps,
                                       optimizer),
                 estimate_model_states(experts, setup, world_size // expert_parallel_size, world_size // num_nodes,
                                       precision, accum_steps, optimizer)]
        states = {key: apart[0][key] + apart[1][key] for key in states}
        shape = replace(shape, n_params=dense.n_params + experts.n_params)
    gathered = 2.0 * weight_bytes(precision, setup.stage) * shape.largest_layer_params if setup.stage == 3 else 0.0
    full, checkpointed = estimate_activations(activation_shape, micro_batch_size, seq_len, precision,
                                              attn_implementation, loss_chunk_tokens, sequence_parallel_size,
                                              tensor_parallel_size)
    activations = checkpointed if gradient_checkpointing else full
    ema_bytes = (4.0 * shape.n_params / (world_size // tensor_parallel_size if setup.stage == 3 else 1)) if ema else 0.0
    return MemoryEstimate(
        **states, gathered=gathered, activations=full, activations_checkpointed=checkpointed,
        device_total=states["model_states_device"] + gathered + ema_bytes + activations, ema=ema_bytes,
    )


def estimate_run(shape: ModelShape, work: Workload, topology: Topology, precision: str, accum_steps: int,
                 num_nodes: int = 1, **changes) -> MemoryEstimate:
    """:func:`estimate` of a recipe's workload (``Config.workload()``) on ``topology``: each setting is read from
    ``work`` here, once. ``changes``: keyword arguments of :func:`estimate` that differ from the recipe's (the
    alternatives the out-of-memory diagnosis weighs: ``setup``, ``micro_batch_size``, ...)."""
    train = work.train
    settings = dict(setup=topology.zero, micro_batch_size=train.micro_batch_size, seq_len=work.data.seq_len,
                    gradient_checkpointing=train.gradient_checkpointing,
                    attn_implementation=work.model.attn_implementation, ema=train.ema_decay > 0,
                    loss_chunk_tokens=train.chunk_tokens(shape.vocab_size),
                    sequence_parallel_size=topology.sequence_parallel_size, optimizer=work.optim.name,
                    tensor_parallel_size=topology.tensor_parallel_size,
                    expert_parallel_size=topology.expert_parallel_size)
    return estimate(shape, world_size=topology.world_size, num_nodes=num_nodes, precision=precision,
                    accum_steps=accum_steps, **{**settings, **changes})


def format_bytes(n: float) -> str:
    """Human-readable binary size: 512 B, 3.2 MiB, 14.6 GiB."""
    if n < 1024:
        return f"{n:.0f} B"
    exponent = min(int(math.log(n, 1024)), 4)
    return f"{n / 1024**exponent:.1f} {('KiB', 'MiB', 'GiB', 'TiB')[exponent - 1]}"


_TABLE_COLUMNS = (
    ("weights", "weights"), ("gradients", "gradients"), ("optimizer", "optimizer"),
    ("model_states_device", "states on device"), ("cpu_per_node", "offloaded / node"), ("gathered", "ZeRO-3 gathered"),
    ("activations", "activations"), ("activations_checkpointed", "act. checkpointed"), ("ema", "weight EMA"),
    ("device_total", "device total"),
)


def format_estimates(rows: list[tuple[str, MemoryEstimate]]) -> str:
    """A fixed-width table of per-rank estimates, one line per config, in one binary unit (MiB, GiB, ...)."""
    largest = max((v for _, est in rows for v in est.to_dict().values()), default=1.0)
    exponent = max(1, min(int(math.log(max(largest, 1.0), 1024)), 4))
    unit = ("KiB", "MiB", "GiB", "TiB")[exponent - 1]
    width = max(len("config"), *(len(name) for name, _ in rows))
    header = "config".ljust(width) + "".join(f"  {title:>17}" for _, title in _TABLE_COLUMNS)
    lines = [f"(in {unit})", header, "-" * len(header)]
    for name, est in rows:
        values = est.to_dict()
        lines.append(name.ljust(width) + "".join(f"  {values[key] / 1024**exponent:>17,.2f}" for key, _ in _TABLE_COLUMNS))
    return "\n".join(lines)
