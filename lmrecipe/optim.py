"""The optimizer (AdamW with weight decay on matrices only, or Muon for hidden matrices with AdamW for the rest)
and the warmup + decay learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch import nn

from lmrecipe.config import OptimConfig, ScheduleConfig


def _ndim(param: nn.Parameter) -> int:
    # ZeRO-3 flattens partitioned parameters; their original shape survives in ds_shape.
    return len(getattr(param, "ds_shape", param.shape))


def _shape(param: nn.Parameter) -> torch.Size:
    return torch.Size(getattr(param, "ds_shape", param.shape))


def split_params(model: nn.Module, decay_embeddings: bool) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """Matrices (decayed), then biases, norm gains and, unless ``decay_embeddings``, embeddings (not decayed)."""
    embedding_ids = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    decay, no_decay, seen = [], [], set()
    for param in model.parameters():
        if not param.requires_grad or id(param) in seen:
            continue
        seen.add(id(param))
        is_embedding = id(param) in embedding_ids
        if _ndim(param) >= 2 and (decay_embeddings or not is_embedding):
            decay.append(param)
        else:
            no_decay.append(param)
    return decay, no_decay


def moe_blocks(model: nn.Module) -> list[nn.Module]:
    """The mixture-of-experts blocks of a Hugging Face model: the modules holding a router (``gate``) and their
    ``experts`` (Qwen2/3-MoE's and Mixtral's sparse MoE blocks, and DeepSpeed AutoEP's layer that replaces them)."""
    return [m for m in model.modules() if hasattr(m, "experts") and (hasattr(m, "gate") or hasattr(m, "router"))]


def expert_params(model: nn.Module) -> list[nn.Parameter]:
    """The routed experts' parameters (each MoE block's ``experts``; the router and shared experts are not)."""
    return [p for block in moe_blocks(model) for p in block.experts.parameters()]


def param_groups(model: nn.Module, optim: OptimConfig, expert_group: str | None = None) -> list[dict]:
    """Two groups: matrices (decayed) and biases, norm gains and, unless configured, embeddings (not decayed).

    ``expert_group``: the name of DeepSpeed's expert-parallel group (AutoEP's ``ep_size_N``); the routed experts'
    parameters then form two more groups of their own, decayed and not, marked ``moe`` (DeepSpeed's ZeRO-1/2 reduce
    them over the expert-data-parallel ranks only, and refuse an MoE model without such groups). AutoEP moves each
    replaced expert weight into the group of the weights it was built from.
    """
    decay, no_decay = split_params(model, optim.decay_embeddings)
    groups = [{"params": decay, "weight_decay": optim.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if expert_group is None:
        return groups
    experts = {id(p) for p in expert_params(model)}
    expert_groups = [{"params": [p for p in g["params"] if id(p) in experts], "weight_decay": g["weight_decay"],
                      "moe": True, "name": expert_group} for g in groups]
    for group in groups:
        group["params"] = [p for p in group["params"] if id(p) not in experts]
    return [g for g in groups + expert_groups if g["params"] or not g.get("moe")]


def optimizer_param_names(model: nn.Module, decay_embeddings: bool, name: str = "adamw") -> list[tuple[str, ...]]:
    """The optimizer's parameters in its order (group by group), each with every name it goes by (tied weights
    have several): what gives the entries of a saved ``optimizer.bin``, which are numbered, their names.
    ``name``: the optimizer (``optim.name``)."""
    names = names_by_param(model)
    split = muon_split if name == "muon" else split_params
    return [tuple(names[id(p)]) for params in split(model, decay_embeddings) for p in params]


def names_by_param(model: nn.Module) -> dict[int, list[str]]:
    """Every name each parameter goes by (tied weights have several), keyed by ``id(parameter)``."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return names


def build_optimizer(model: nn.Module, optim: OptimConfig, cpu_offload: bool, fused: bool = False,
                    expert_group: str | None = None) -> torch.optim.Optimizer:
    """AdamW (``optim.name=adamw``); DeepSpeed's CPU Adam when ZeRO offloads the optimizer state (its update runs on
    the CPU); or DeepSpeed's Muon (``optim.name=muon``, :func:`build_muon`).

    ``fused``: torch's fused AdamW, one kernel for all parameters (under DeepSpeed, for the fp32 partitions each rank
    updates) instead of foreach's kernel per operation; without DeepSpeed it also skips its update on the device
    (``found_inf``), so that a non-finite gradient costs no host sync (under DeepSpeed the engine decides). Not with
    fp16 without DeepSpeed, where the GradScaler steps the optimizer. ``expert_group``: DeepSpeed AutoEP's
    expert-parallel group (:func:`param_groups`).
    """
    if optim.name == "muon":
        return build_muon(model, optim)
    groups = param_groups(model, optim, expert_group)
    kwargs = dict(lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps)
    if cpu_offload:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, adamw_mode=True, **kwargs)
    return torch.optim.AdamW(groups, fused=fused or None, **kwargs)


def muon_split(model: nn.Module, decay_embeddings: bool) -> tuple[list[nn.Parameter], list[nn.Parameter], list[nn.Parameter]]:
    """Muon's hidden matrices (2-D, neither an embedding nor the output layer), then AdamW's decayed parameters
    (the output layer, and the embeddings with ``decay_embeddings``), then AdamW's undecayed ones (biases, norm
    gains, embeddings). Muon's matrices are in Muon's own order (largest first), so that the optimizer's
    parameter order is this one."""
    out = model.get_output_embeddings()
    output_ids = {id(p) for p in out.parameters()} if out is not None else set()
    decay, no_decay = split_params(model, decay_embeddings)
    embedding_ids = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    hidden = [p for p in decay if id(p) not in output_ids and id(p) not in embedding_ids]
    hidden_ids = {id(p) for p in hidden}
    adam_decay = [p for p in decay if id(p) not in hidden_ids]
    return sorted(hidden, key=_shape, reverse=True), adam_decay, no_decay


def build_muon(model: nn.Module, optim: OptimConfig) -> torch.optim.Optimizer:
    """DeepSpeed's ``MuonWithAuxAdam``: Muon (momentum ``optim.muon_momentum``, peak learning rate
    ``optim.muon_lr``, decoupled weight decay ``optim.weight_decay``) for the hidden matrices, AdamW (``optim.lr``,
    betas, eps) for embeddings, norms, biases and the output layer (:func:`muon_split`).

    Every parameter is tagged ``use_muon``: DeepSpeed's ZeRO optimizers read the tag to orthogonalise a matrix's
    whole gradient before it is partitioned. Without DeepSpeed the optimizer runs Muon itself on each full
    gradient. Each group carries ``lr_scale`` (its peak over ``optim.lr``) for :func:`set_lr`.
    """
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam

    hidden, adam_decay, adam_no_decay = muon_split(model, optim.decay_embeddings)
    hidden_ids = {id(p) for p in hidden}
    for param in model.parameters():
        param.use_muon = id(param) in hidden_ids
    adam = dict(use_muon=False, lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps, lr_scale=1.0)
    groups = [dict(params=hidden, use_muon=True, lr=optim.muon_lr, momentum=optim.muon_momentum,
                   weight_decay=optim.weight_decay, lr_scale=optim.muon_lr / optim.lr),
              dict(params=adam_decay, weight_decay=optim.weight_decay, **adam),
              dict(params=adam_no_decay, weight_decay=0.0, **adam)]
    return MuonWithAuxAdam([g for g in groups if g["params"]], adam_w_mode=True)


def lr_at(step: int, max_steps: int, optim: OptimConfig, schedule: ScheduleConfig) -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warmup, then decay to ``min_lr``.

    Warmup: step ``s < warmup_steps`` uses ``lr x (s + 1) / warmup_steps`` (the first step already trains, at
    ``lr / warmup_steps``; step ``warmup_steps - 1`` reaches ``lr``). Decay: from ``lr`` at step ``warmup_steps``
    to ``min_lr`` at step ``max_steps - 1``, the last step trained. Warmup-stable-decay (``schedule.decay_steps`` or
    ``decay_fraction``: ``D`` steps): ``lr`` up to step ``max_steps - D - 1``, then step ``max_steps - D + i``
    (``i`` = 0 .. D-1) at progress ``(i + 1) / D`` of the decay's shape, so each of the ``D`` steps is below ``lr``
    and the last is at ``min_lr``. A pure function of the step and ``max_steps``, so it advances exactly once per
    optimizer step on any number of processes, and a resumed run needs only the step (with a new ``max_steps``,
    the schedule of the new length).
    """
    warmup = schedule.warmup_steps
    if step < warmup:
        return optim.lr * (step + 1) / warmup
    start = schedule.decay_start(max_steps)
    if start is not None:
        if step < start:
            return optim.lr
        progress = min(1.0, (step - start + 1) / (max_steps - start))
        return optim.min_lr + (optim.lr - optim.min_lr) * decay_shape(schedule.decay, progress, drop=True)
    if schedule.decay == "constant":
        return optim.lr
    decay_steps = max(1, max_steps - 1 - warmup)
    progress = min(1.0, (step - warmup) / decay_steps)
    return optim.min_lr + (optim.lr - optim.min_lr) * decay_shape(schedule.decay, progress)


def decay_shape(decay: str, progress: float, drop: bool = False) -> float:
    """The share of ``lr - min_lr`` left at ``progress`` (0 to 1) of a decay of shape ``decay``; ``constant``
    keeps all of it, or none with ``drop`` (a warmup-stable-decay run's step down to ``min_lr``)."""
    if decay == "linear":
        return 1.0 - progress
    if decay == "1-sqrt":
        return 1.0 - math.sqrt(progress)
    if decay == "constant":
        return 0.0 if drop else 1.0
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def in_decay(step: int, max_steps: int, schedule: ScheduleConfig) -> bool:
    """Whether optimizer step ``step`` (0-based) of a warmup-stable-decay run of ``max_steps`` is in its decay."""
    start = schedule.decay_start(max_steps)
    return start is not None and step >= start


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Every group at ``lr``, scaled by the group's ``lr_scale`` where it has one (Muon's matrices)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)
