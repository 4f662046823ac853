"""What an MoE model's routers really chose, and the routing bias that auxiliary-loss-free balancing moves.

**The load** (tokens routed to each expert of each MoE layer, ``[layers, experts]``) is counted from the experts the
routers chose, not from the router's logits: DeepSeek-V3's router picks its top-k from the sigmoid scores plus a
per-expert bias (``e_score_correction_bias``), within the top ``topk_group`` of ``n_group`` groups, so a top-k of its
logits counts experts it never sent a token to. :class:`RouterLoads` hooks every router's forward
(``register_forward_hook``) and reads its choice from what the router returns: transformers' routers (Qwen3-MoE,
Qwen2-MoE, Mixtral, DeepSeek-V3, Qwen3.5-MoE) return ``(logits, weights, indices)``, the indices ``[tokens, top_k]``
counted by a scatter-add; DeepSpeed AutoEP's router returns ``(weights, indices, tokens_per_expert)``, its own
histogram ``[experts]`` taken as it is.
Counts are recorded only inside :meth:`RouterLoads.recording` (the training forward), so an activation checkpoint's
recompute in the backward and the validation forwards add nothing. Nothing is read on the host.

**The routing bias** (``model.router_bias_update_rate``): DeepSeek-V3's auxiliary-loss-free balancing (DeepSeek-AI,
"DeepSeek-V3 Technical Report", arXiv:2412.19437, section 2.1.2, after Wang et al., arXiv:2408.15664): at the end of
each step every expert's bias moves by ``rate * sign(mean load - load)``, down for an overloaded expert and up for an
underloaded one (:func:`update_routing_biases_`). The bias only chooses experts; the gate weights of the chosen ones
come from the unbiased scores. It is a buffer of the model (the class's router, or AutoEP's router copy of it), so the
checkpoint and the export hold it; it is kept in fp32 (:func:`keep_biases_fp32`), where steps of 1e-3 are not rounded
away.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator

import torch
from torch import nn

from lmrecipe.optim import moe_blocks

logger = logging.getLogger(__name__)

BIAS = "e_score_correction_bias"
"""The routing bias's name in transformers' DeepSeek-V3 router and in DeepSpeed AutoEP's router copy of it."""


def routers(model: nn.Module) -> list[nn.Module]:
    """Each MoE layer's router, in layer order: DeepSpeed AutoEP's ``router`` where AutoEP replaced the block, else the
    class's ``gate``."""
    found = []
    for block in moe_blocks(model):
        router = getattr(block, "router", None)
        found.append(router if isinstance(router, nn.Module) else block.gate)
    return found


def expert_count(router: nn.Module) -> int:
    """The routed experts a router chooses among (its ``num_experts``; AutoEP's router too)."""
    experts = getattr(router, "num_experts", None)
    if experts is None:
        raise TypeError(f"{type(router).__name__} has no num_experts: not a router this recipe can count")
    return int(experts)


def expert_tokens(chosen: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Tokens routed to each expert, ``[num_experts]`` fp32, from a router's choice: its chosen indices
    ``[tokens, top_k]`` (each token counts once for each expert it was sent to), or a histogram ``[num_experts]``
    already counted (AutoEP's ``tokens_per_expert``). A scatter-add: nothing is read on the host."""
    chosen = chosen.detach()
    if chosen.ndim == 1:
        return chosen.float()
    picked = chosen.flatten()
    return torch.zeros(num_experts, dtype=torch.float32, device=picked.device).scatter_add_(
        0, picked, torch.ones_like(picked, dtype=torch.float32))


def build_router_loads(model: nn.Module) -> "RouterLoads | None":
    """The load counter of an MoE model's routers; None for a dense model, or (with a warning) for a class whose
    routers do not say how many experts they choose among."""
    if not moe_blocks(model):
        return None
    try:
        return RouterLoads(model)
    except TypeError as err:
        logger.warning("The expert load is not counted: %s", err)
        return None


class RouterLoads:
    """Counts the tokens each router sent to each expert during :meth:`recording` (a forward hook per router)."""

    def __init__(self, model: nn.Module):
        self.routers = routers(model)
        self.num_experts = [expert_count(router) for router in self.routers]
        self._counts: list[torch.Tensor | None] | None = None
        self._warned = False
        self._handles = [router.register_forward_hook(self._hook(layer)) for layer, router in enumerate(self.routers)]

    def _hook(self, layer: int):
        def count(module, args, output) -> None:
            if self._counts is None:
                return  # a validation forward, or an activation checkpoint's recompute in the backward
            if not isinstance(output, tuple) or len(output) < 3:
                if not self._warned:
                    logger.warning("%s returns %s, not the (logits, weights, indices) of a transformers router nor "
                                   "AutoEP's (weights, indices, tokens per expert): the expert load is not counted",
                                   type(module).__name__, type(output).__name__)
                    self._warned = True
                return  # the layer's count stays None: no load is logged
            tokens = expert_tokens(output[2], self.num_experts[layer])
            previous = self._counts[layer]
            self._counts[layer] = tokens if previous is None else previous + tokens
        return count

    @contextlib.contextmanager
    def recording(self) -> Iterator[list[torch.Tensor | None]]:
        """Count the routers' choices of the forwards inside; yields the per-layer counts (filled as they run)."""
        self._counts = [None] * len(self.routers)
        counts = self._counts
        try:
            yield counts
        finally:
            self._counts = None

    @staticmethod
    def stacked(counts: list[torch.Tensor | None]) -> torch.Tensor | None:
        """The counts of a recording as ``[layers, experts]``; None when no router ran."""
        if not counts or any(c is None for c in counts):
            return None
        return torch.stack(counts)

    def remove(self) -> None:
        """Take the hooks off the routers."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


def routing_biases(model: nn.Module) -> list[torch.Tensor]:
    """Each MoE layer's routing bias (``e_score_correction_bias``), in the order of :func:`routers`; empty when the
    routers have none. A model whose routers have it in some layers only is refused (ValueError)."""
    biases = [getattr(router, BIAS, None) for router in routers(model)]
    if any(b is None for b in biases):
        if all(b is None for b in biases):
            return []
        raise ValueError("some MoE layers' routers have a routing bias and others not")
    return biases


def keep_biases_fp32(model: nn.Module) -> None:
    """Make every router's routing bias an fp32 buffer (a bf16 engine casts the module's buffers with its weights)."""
    for router in routers(model):
        bias = getattr(router, BIAS, None)
        if bias is not None and bias.dtype != torch.float32:
            if BIAS in router._buffers:
                router._buffers[BIAS] = bias.float()
            else:
                bias.data = bias.data.float()


@torch.no_grad()
def update_routing_biases_(biases: list[torch.Tensor], tokens: torch.Tensor, rate: float,
                           skipped: torch.Tensor | bool = False) -> None:
    """DeepSeek-V3's update (module docstring): ``bias += rate * sign(mean(load) - load)`` per layer, from ``tokens``
    ``[layers, experts]`` (the step's loads, the same on every rank). ``skipped``: the step's update was skipped (a
    non-finite gradient), and so is this one; a device flag, so nothing is read on the host."""
    if skipped is True:
        return
    for bias, load in zip(biases, tokens):
        load = load.float()
        step = rate * torch.sign(load.mean() - load)
        if isinstance(skipped, torch.Tensor):
            step = step * (~skipped.to(step.device)).float()
        bias.add_(step.to(bias.device, bias.dtype))
