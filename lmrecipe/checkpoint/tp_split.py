"""Tensor-parallel checkpoints: which parameters DeepSpeed AutoTP split, and putting their slices together again.

Under ``distributed.tensor_parallel_size`` = t DeepSpeed saves one set of files per tensor-parallel rank
(``mp_rank_XX``): each holds that rank's slice of every split matrix (for a Llama layer ``q/k/v/gate/up_proj`` by
output rows, ``o/down_proj`` by input columns) and a whole copy of every other parameter. A checkpoint records, per
split parameter, the dimension and the sizes of its slices (``train_state.json``: ``tensor_parallel``), read from
AutoTP's own per-parameter metadata when it is saved. The export and the topology-free form concatenate the
slices along that dimension; a tensor-parallel resume from the topology-free form takes its own rank's slice.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from lmrecipe.errors import fail
from lmrecipe.model.build import bare_parameter_name

RECORD_KEY = "tensor_parallel"
"""Where ``train_state.json`` keeps ``{parameter name: {"dim": d, "sizes": [slice sizes by rank]}}``."""

Splits = Mapping[str, Mapping]


def splits_of(module: torch.nn.Module) -> dict[str, dict]:
    """``{name: {"dim", "sizes"}}`` of every parameter AutoTP split in ``module`` (empty without tensor
    parallelism). A fused layout (one matrix holding several, as a packed ``qkv``) is refused: its slices are not one
    contiguous range of the whole."""
    from deepspeed.checkpoint.constants import DS_AUTOTP_UC_META

    found = {}
    for name, param in module.named_parameters():
        meta = getattr(param, DS_AUTOTP_UC_META, None)
        if meta is None or meta.get("replicated") or meta.get("partition_dim") is None:
            continue
        if meta.get("sub_param_sizes"):
            raise fail(f"distributed.tensor_parallel_size: {name} is a fused matrix that AutoTP splits piece by piece; "
                       "this recipe saves only models whose split matrices are single (Llama, Qwen, Mistral). Set "
                       "distributed.tensor_parallel_size=1 for this model.")
        sizes = [int(x) for x in meta["partition_sizes"]]
        found[bare_parameter_name(name)] = {"dim": int(meta["partition_dim"]), "sizes": sizes}
    return found


def full_shape(local: Sequence[int], split: Mapping | None) -> tuple[int, ...]:
    """The whole parameter's shape from one rank's slice shape."""
    shape = list(local)
    if split is not None:
        shape[split["dim"]] = sum(split["sizes"])
    return tuple(shape)


def merge(pieces: Sequence[torch.Tensor], split: Mapping | None) -> torch.Tensor:
    """The whole tensor from the ranks' slices, in rank order (a parameter that is not split: rank 0's copy)."""
    if split is None:
        return pieces[0]
    for rank, (piece, size) in enumerate(zip(pieces, split["sizes"])):
        if piece.shape[split["dim"]] != size:
            raise fail(f"Tensor-parallel rank {rank}'s slice has {piece.shape[split['dim']]} rows along dimension "
                       f"{split['dim']} where the checkpoint records {size}: it was written by different code.")
    return torch.cat(list(pieces), dim=split["dim"])


def local_slice(full: torch.Tensor, split: Mapping | None, rank: int) -> torch.Tensor:
    """Tensor-parallel rank ``rank``'s slice of the whole tensor ``full`` (a copy of its own)."""
    if split is None:
        return full
    sizes = split["sizes"]
    return full.narrow(split["dim"], sum(sizes[:rank]), sizes[rank]).contiguous()
