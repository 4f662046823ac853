"""DeepSpeed AutoEP checkpoints: which parameters hold routed experts, which experts each rank holds, and one rank's
experts of a whole expert tensor.

Under AutoEP an MoE layer's routed experts are three parameters of the layer's ``experts`` module: ``w1`` (gate) and
``w3`` (up), ``[experts, ffn, hidden]``, and ``w2`` (down), ``[experts, hidden, ffn]``; a rank holds only the
experts of its expert-parallel rank (``rank % size``: DeepSpeed groups consecutive ranks), and ZeRO partitions them
over the ranks holding the same experts (``range(ep_rank, world_size, size)``), apart from the other parameters.
A checkpoint's model states record, per layer, the expert count, the size and each expert-parallel rank's experts
(``ds_autoep_layers``). The readers put the ranks' pieces together into the whole tensor ``[experts, ...]`` under
the parameter's own name (``model.layers.0.mlp.experts.w1``), which is what the topology-free form and the export
hold, whatever the size that saved it; a run at any size loads its own experts back from it (:func:`local_experts`,
:func:`experts_of`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from lmrecipe.errors import fail
from lmrecipe.model.build import bare_parameter_name

EXPERT_WEIGHTS = ("w1", "w2", "w3")
"""The parameters of an AutoEP layer's ``experts`` module: gate, down and up projections of every local expert."""


@dataclass(frozen=True)
class ExpertSplit:
    """How one expert parameter was cut: the expert count and the experts of each expert-parallel rank."""

    num_experts: int
    by_rank: tuple[tuple[int, ...], ...]

    @property
    def size(self) -> int:
        """The expert-parallel size (``distributed.expert_parallel_size``) of the run that saved it."""
        return len(self.by_rank)

    def ranks_of(self, ep_rank: int, world_size: int) -> list[int]:
        """The ranks holding expert-parallel rank ``ep_rank``'s experts, in the order ZeRO partitions them."""
        return list(range(ep_rank, world_size, self.size))

    def whole_shape(self, local: Sequence[int]) -> tuple[int, ...]:
        """The shape of the whole tensor from one rank's (``[local experts, ...]``)."""
        return (self.num_experts, *(int(d) for d in local[1:]))


def expert_splits(layers: Sequence[Mapping] | None) -> dict[str, ExpertSplit]:
    """``{parameter name: ExpertSplit}`` of every expert parameter a checkpoint's ``ds_autoep_layers`` record names
    (empty for a checkpoint without AutoEP). An expert placement DeepSpeed does not record is its default: rank ``r``
    holds experts ``[r n, (r + 1) n)``, ``n = experts / size``."""
    found = {}
    for layer in layers or ():
        try:
            num, size = int(layer["num_experts"]), int(layer["ep_size"])
            placement = layer.get("expert_placement")
            if placement is not None:
                by_rank = {int(e["rank"]): tuple(int(x) for x in e["experts"]) for e in placement["ranks"]}
                by_rank = tuple(by_rank[r] for r in range(size))
            else:
                local = num // size
                by_rank = tuple(tuple(range(r * local, (r + 1) * local)) for r in range(size))
            prefix = layer["expert_key_prefix"]
        except (KeyError, TypeError, ValueError) as err:
            raise fail(f"The checkpoint's AutoEP layer record ({err!r} in ds_autoep_layers) is incomplete: it was "
                       "written by a DeepSpeed this recipe does not read.") from None
        if sorted(e for experts in by_rank for e in experts) != list(range(num)):
            raise fail(f"The checkpoint's AutoEP placement of {prefix} does not hold each of its {num} experts once: "
                       "it was written by a DeepSpeed this recipe does not read.")
        for weight in EXPERT_WEIGHTS:
            found[f"{prefix}.{weight}"] = ExpertSplit(num, by_rank)
    return found


def local_experts(module: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """``{parameter name: the experts this rank holds}`` of every AutoEP expert parameter of a prepared model, from
    the placement DeepSpeed attaches to each (empty without AutoEP)."""
    from deepspeed.checkpoint.constants import AUTOEP_PARAM_LOCAL_EXPERTS, DS_AUTOEP_UC_META

    found = {}
    for name, param in module.named_parameters():
        meta = getattr(param, DS_AUTOEP_UC_META, None)
        if meta is not None and AUTOEP_PARAM_LOCAL_EXPERTS in meta:
            found[bare_parameter_name(name)] = tuple(int(e) for e in meta[AUTOEP_PARAM_LOCAL_EXPERTS])
    return found


def contiguous(experts: Sequence[int]) -> bool:
    return list(experts) == list(range(experts[0], experts[0] + len(experts))) if experts else True


def experts_of(whole: torch.Tensor, experts: Sequence[int]) -> torch.Tensor:
    """The rows ``experts`` (in that order) of a whole expert tensor: one rank's local experts (a copy of its own)."""
    if contiguous(experts):
        return whole.narrow(0, experts[0], len(experts)).clone() if experts else whole[:0].clone()
    return whole.index_select(0, torch.tensor(list(experts), dtype=torch.long))


def place(whole: torch.Tensor, local: torch.Tensor, experts: Sequence[int]) -> None:
    """Write one rank's ``local`` experts into their rows of ``whole``."""
    if local.shape[0] != len(experts):
        raise fail(f"An AutoEP rank's piece holds {local.shape[0]} experts where the checkpoint records "
                   f"{len(experts)}: it was written by different code.")
    whole[list(experts)] = local
