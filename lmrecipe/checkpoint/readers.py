"""The readers of a checkpoint's saved optimizer state, one parameter at a time (the export and the topology-free form).

:func:`open_source` gives the state of a checkpoint as ``shapes`` and ``steps`` by parameter name and ``read(key,
name)``, the full fp32 tensor of the weights (``fp32``) or of one of AdamW's moments (``exp_avg``, ``exp_avg_sq``).
DeepSpeed's ZeRO-1/2/3 shards are memory-mapped and read fragment by fragment with the offsets of DeepSpeed's own
reconstruction (``zero_to_fp32``), DeepSpeed AutoEP's experts whole from every expert-parallel rank's share
(``ep_split.py``); a tensor-parallel run's slices are put together again (``tp_split.py``);
``optimizer.bin`` (no DeepSpeed) is read with the tensors-only unpickler (memory-mapped too) and named from the
optimizer's groups. Pages of the mapped files are released once read, so a process holds one full tensor at a
time, whatever the model's size.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import mmap
import sys
from pathlib import Path
from typing import Iterable, Mapping, Protocol, Sequence

import torch

from lmrecipe.checkpoint.ep_split import expert_splits, place
from lmrecipe.checkpoint.tp_split import full_shape, merge
from lmrecipe.errors import fail
from lmrecipe.model.build import bare_parameter_name

logger = logging.getLogger(__name__)

_CHUNK_VALUES = 1 << 22
"""Values copied from a memory-mapped shard before its pages are released (16 MB of fp32)."""

ParamNames = Sequence[Sequence[str]]
"""Every parameter of the optimizer in its order (group by group), each with all the names it goes by (a tied
weight has several)."""


class StateSource(Protocol):
    """A checkpoint's saved state by parameter name, as :func:`open_source` opens it."""

    shapes: dict[str, tuple[int, ...]]
    """Each parameter's full shape, in the optimizer's order."""
    steps: dict[str, int]
    """Each parameter's AdamW step count."""

    def read(self, key: str, name: str) -> torch.Tensor:
        """The full fp32 tensor of ``key`` (``fp32``, ``exp_avg`` or ``exp_avg_sq``) of parameter ``name``."""

    def close(self) -> None:
        """Drop the mapped files."""


class _PageRelease:
    """Drops the pages of memory-mapped checkpoint files from this process's resident memory once they are read.

    A page of a file mapping that has been read stays resident (and counted) until the mapping goes; over a whole
    conversion that is every shard. Only ranges inside a mapping of the given files (checked against
    ``/proc/self/maps``) are released; the conversion only reads them, so a released page is read again from the
    file if needed. Elsewhere than Linux nothing is released.
    """

    _MADV_DONTNEED = 4

    def __init__(self, files: Iterable[Path]):
        self.ranges: list[tuple[int, int]] = []
        self._madvise = None
        if not sys.platform.startswith("linux"):
            return
        names = {str(Path(f).resolve()) for f in files}
        with open("/proc/self/maps") as fh:
            for line in fh:
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and parts[5].strip() in names:
                    lo, hi = (int(x, 16) for x in parts[0].split("-"))
                    self.ranges.append((lo, hi))
        self._madvise = ctypes.CDLL(None, use_errno=True).madvise
        self._madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)

    def __call__(self, tensor: torch.Tensor) -> None:
        start = tensor.data_ptr()
        lo = start // mmap.PAGESIZE * mmap.PAGESIZE
        hi = -(-(start + tensor.numel() * tensor.element_size()) // mmap.PAGESIZE) * mmap.PAGESIZE
        if self._madvise is not None and any(a <= lo and hi <= b for a, b in self.ranges):
            self._madvise(lo, hi - lo, self._MADV_DONTNEED)


def _load_mapped(path: Path, weights_only: bool):
    """``torch.load`` memory-mapped (nothing is read until used); a file in torch's legacy format is read whole."""
    try:
        return torch.load(path, map_location="cpu", mmap=True, weights_only=weights_only)
    except RuntimeError as err:
        if "mmap" not in str(err):
            raise
        logger.info("%s is in torch's legacy format and cannot be memory-mapped; it is read whole.", path)
        return torch.load(path, map_location="cpu", weights_only=weights_only)


def _copy_range(pieces: Sequence[torch.Tensor], start: int, out: torch.Tensor, release: _PageRelease) -> None:
    """Fill 1-D ``out`` with ``pieces`` (1-D, read as one concatenation) from element ``start`` on."""
    end, pos, filled = start + out.numel(), 0, 0
    for piece in pieces:
        flat = piece.reshape(-1)
        for lo in range(max(start, pos), min(end, pos + piece.numel()), _CHUNK_VALUES):
            hi = min(end, pos + piece.numel(), lo + _CHUNK_VALUES)
            part = flat[lo - pos:hi - pos]
            out[lo - start:hi - start].copy_(part)
            release(part)  # chunk by chunk: the source pages in memory stay a few MB, not a second tensor
            filled += hi - lo
        pos += piece.numel()
        if pos >= end:
            break
    if filled != out.numel():
        raise fail(f"The checkpoint's optimizer shards hold {filled} of the {out.numel()} values a parameter needs at "
                   f"offset {start}: they are incomplete or were written by different code.")


class _ZeroSource:
    """ZeRO-1/2/3 shards, read one parameter's state at a time with DeepSpeed's reconstruction offsets.

    Each group of parameters (ZeRO-1/2: an optimizer group; ZeRO-3: a sub-group) is partitioned over its ranks. Those
    ranks are every rank, except for DeepSpeed AutoEP's experts (``ep_split.py``): each expert-parallel rank's experts
    are partitioned over the ranks holding them, and the whole tensor is those ranks' pieces put in their rows."""

    def __init__(self, ds_dir: Path, mp_rank: int | None = None):
        """``mp_rank``: read only the files of this tensor-parallel rank (None: a checkpoint without tensor
        parallelism)."""
        from deepspeed.utils import zero_to_fp32 as z

        if mp_rank is None:
            # AutoEP's files of one expert each (layer_L_expert_E_...) sort first; the engine's own is the other.
            model_file = Path(next(f for f in z.get_model_state_files(str(ds_dir)) if not Path(f).name.startswith("layer_")))
            optim_files = [Path(f) for f in z.get_optim_files(str(ds_dir))]
        else:
            model_file = ds_dir / f"mp_rank_{mp_rank:02d}_model_states.pt"
            optim_files = [Path(f) for f in z.get_optim_files(str(ds_dir)) if f"_mp_rank_{mp_rank:02d}_" in Path(f).name]
            if not model_file.is_file() or not optim_files:
                raise fail(f"{ds_dir} lacks the files of tensor-parallel rank {mp_rank} ({model_file.name}, "
                           f"*_mp_rank_{mp_rank:02d}_optim_states.pt): the checkpoint is incomplete.")
        model_state = _load_mapped(model_file, weights_only=False)  # its module weights stay unread
        param_shapes = [dict(group) for group in model_state["param_shapes"]]
        self.experts = expert_splits(model_state.get("ds_autoep_layers"))
        del model_state
        shards = [_load_mapped(f, weights_only=False)["optimizer_state_dict"] for f in optim_files]
        self.release = _PageRelease(optim_files)
        self.stage = int(shards[0]["zero_stage"])
        world_size = shards[0]["partition_count"]
        self.world_size = max(world_size) if isinstance(world_size, list) else int(world_size)
        if len(shards) != self.world_size:
            raise fail(f"{ds_dir} holds {len(shards)} optimizer shards for a world size of {self.world_size}: it is "
                       "incomplete.")
        if self.stage <= 2:
            self.flat = [s["single_partition_of_fp32_groups"] for s in shards]
            inner = [s["base_optimizer_state"]["state"] for s in shards]
        else:
            self.flat = [s["fp32_flat_groups"] for s in shards]
            inner = [s["optimizer_state_dict"]["state"] for s in shards]
        self.inner = inner
        self.local_shapes = {name: tuple(shape) for group in param_shapes for name, shape in group.items()}
        self.shapes = {name: self.experts[name].whole_shape(shape) if name in self.experts else shape
                       for name, shape in self.local_shapes.items()}
        self.steps = {name: int(torch.as_tensor(inner[0][g]["step"]).item())
                      for g, group in enumerate(param_shapes) for name in group}
        self.replicas = [self._group_ranks(g, list(group), shards) for g, group in enumerate(param_shapes)]
        self.where = (self._zero2_offsets(param_shapes, shards[0].get("param_alignment_paddings")) if self.stage <= 2
                      else self._zero3_offsets(param_shapes))

    def _group_ranks(self, group: int, names: list[str], shards: list[dict]) -> list[list[int]]:
        """The ranks group ``group`` is partitioned over, in partition order: one list (every rank), or for AutoEP
        experts one list per expert-parallel rank. Checked against the partition counts DeepSpeed records."""
        split = self.experts.get(names[0]) if names else None
        if any((self.experts.get(name) is None) != (split is None) for name in names):
            raise fail(f"A ZeRO group of the checkpoint mixes AutoEP experts with other parameters ({names[0]}, ...): "
                       "it was written by different code.")
        replicas = ([list(range(self.world_size))] if split is None
                    else [split.ranks_of(ep_rank, self.world_size) for ep_rank in range(split.size)])
        for rank, shard in enumerate(shards):
            mine = next(ranks for ranks in replicas if rank in ranks)
            partitions = shard.get("ds_zero_partition_groups")  # ZeRO-3: each sub-group's ranks, as DeepSpeed cut it
            counts = shard["partition_count"]  # ZeRO-1/2: each group's rank count
            if partitions is not None:
                agrees = [int(r) for r in partitions[group]["partition_ranks"]] == mine
            else:
                agrees = not isinstance(counts, list) or int(counts[group]) == len(mine)
            if not agrees:
                raise fail(f"The ZeRO shards' group {group} is partitioned differently from the AutoEP record of the "
                           f"checkpoint (rank {rank}): it was written by different code.")
        return replicas

    def _zero2_offsets(self, param_shapes: list[dict], paddings) -> dict[str, tuple[int, int]]:
        """(group, offset in the group's ranks' partitions laid end to end), as ``_zero2_merge_trainable_params``."""
        where = {}
        for group, shapes in enumerate(param_shapes):
            offset = 0
            for i, (name, shape) in enumerate(shapes.items()):
                where[name] = (group, offset)
                offset += math.prod(shape) + (paddings[group][i] if paddings is not None else 0)
            ranks = self.replicas[group][0]
            align = 2 * len(ranks)
            avail = sum(self.flat[rank][group].numel() for rank in ranks)
            if align * math.ceil(offset / align) != align * math.ceil(avail / align):
                raise fail(f"The ZeRO shards' group {group} holds {avail} values where its parameters take {offset}: "
                           "the checkpoint was written by different code.")
        return where

    def _zero3_offsets(self, param_shapes: list[dict]) -> dict[str, tuple[int, int]]:
        """(group, offset in each of the group's ranks' partitions), as ``_zero3_merge_trainable_params``: a parameter
        takes ``ceil(numel / ranks)`` values of each rank's partition."""
        where = {}
        for group, shapes in enumerate(param_shapes):
            offset, ranks = 0, self.replicas[group][0]
            for name, shape in shapes.items():
                where[name] = (group, offset)
                offset += math.ceil(math.prod(shape) / len(ranks))
            avail = self.flat[ranks[0]][group].numel()
            if offset != avail:
                raise fail(f"The ZeRO-3 shards' group {group} holds {avail} values per rank where its parameters take "
                           f"{offset}: the checkpoint was written by different code.")
        return where

    def _partition(self, rank: int, key: str, group: int) -> torch.Tensor:
        return self.flat[rank][group] if key == "fp32" else self.inner[rank][group][key]

    def _read_local(self, key: str, name: str, ranks: list[int]) -> torch.Tensor:
        """The tensor of ``name`` that ``ranks`` partition (one expert-parallel rank's experts, or the whole)."""
        group, offset = self.where[name]
        out = torch.empty(math.prod(self.local_shapes[name]), dtype=torch.float32)
        if self.stage <= 2:
            _copy_range([self._partition(r, key, group) for r in ranks], offset, out, self.release)
        else:
            per_rank = math.ceil(out.numel() / len(ranks))
            for i, rank in enumerate(ranks):
                dst = out[i * per_rank:(i + 1) * per_rank]  # the last rank's piece ends with padding
                if dst.numel():
                    _copy_range([self._partition(rank, key, group)], offset, dst, self.release)
        return out.view(self.local_shapes[name])

    def read(self, key: str, name: str) -> torch.Tensor:
        replicas = self.replicas[self.where[name][0]]
        split = self.experts.get(name)
        if split is None:
            return self._read_local(key, name, replicas[0])
        whole = torch.empty(self.shapes[name], dtype=torch.float32)
        for ep_rank, ranks in enumerate(replicas):
            place(whole, self._read_local(key, name, ranks), split.by_rank[ep_rank])
        return whole

    def close(self) -> None:
        self.flat = self.inner = None


class _TensorParallelSource:
    """ZeRO shards of a tensor-parallel run: one :class:`_ZeroSource` per tensor-parallel rank, the split
    parameters' slices concatenated (``tp_split.py``); the others are read from rank 0."""

    def __init__(self, ds_dir: Path, size: int, splits: Mapping[str, Mapping]):
        self.sources = [_ZeroSource(ds_dir, rank) for rank in range(size)]
        self.splits = splits
        first = self.sources[0]
        self.shapes = {name: full_shape(shape, splits.get(name)) for name, shape in first.shapes.items()}
        self.steps = first.steps

    def read(self, key: str, name: str) -> torch.Tensor:
        split = self.splits.get(name)
        if split is None:
            return self.sources[0].read(key, name)
        return merge([source.read(key, name) for source in self.sources], split)

    def close(self) -> None:
        for source in self.sources:
            source.close()


class _PlainSource:
    """``model.safetensors`` + ``optimizer.bin`` (no DeepSpeed), named by the optimizer's order."""

    def __init__(self, checkpoint: Path, param_names: ParamNames):
        from safetensors import safe_open

        self.weights_file = checkpoint / "model.safetensors"
        with safe_open(self.weights_file, framework="pt") as fh:
            stored = {bare_parameter_name(name): name for name in fh.keys()}
            shapes = {name: tuple(fh.get_slice(name).get_shape()) for name in fh.keys()}
        optim = _load_mapped(checkpoint / "optimizer.bin", weights_only=True)
        self.release = _PageRelease([checkpoint / "optimizer.bin"])
        order = [index for group in optim["param_groups"] for index in group["params"]]
        if len(order) != len(param_names):
            raise fail(f"{checkpoint / 'optimizer.bin'} holds {len(order)} parameters but the model has "
                       f"{len(param_names)}: the checkpoint belongs to another model.")
        self.state = optim["state"]
        self.shapes, self.steps, self.index, self.stored = {}, {}, {}, {}
        for index, names in zip(order, param_names):
            found = next((n for n in names if n in stored), None)
            if found is None:
                raise fail(f"{self.weights_file} has no weight named {' or '.join(names)}.")
            name = names[0]
            self.stored[name], self.index[name] = stored[found], index
            self.shapes[name] = shapes[stored[found]]
            entry = self.state.get(index)  # none: never stepped (the checkpoint of step 0)
            self.steps[name] = 0 if entry is None else int(torch.as_tensor(entry["step"]).item())

    def read(self, key: str, name: str) -> torch.Tensor:
        if key == "fp32":
            from safetensors import safe_open

            with safe_open(self.weights_file, framework="pt") as fh:  # closed: its pages leave this process
                return fh.get_tensor(self.stored[name]).float()
        entry = self.state.get(self.index[name])
        if entry is None:
            return torch.zeros(self.shapes[name], dtype=torch.float32)
        mapped = entry[key]
        value = mapped.to(torch.float32, copy=True)
        self.release(mapped)
        return value

    def close(self) -> None:
        self.state = None


def open_source(checkpoint: Path, *, deepspeed_dir: Path | None, param_names: ParamNames,
                tensor_parallel: tuple[int, Mapping[str, Mapping]] = (1, {})) -> StateSource:
    """The checkpoint's state, readable one parameter at a time: ``shapes`` and ``steps`` by name, ``read(key,
    name)`` a full fp32 tensor, ``close()``. ``deepspeed_dir``: the folder of its ZeRO shards, or None for a
    checkpoint without DeepSpeed, whose ``optimizer.bin`` ``param_names`` names by position. ``tensor_parallel``:
    the saving run's tensor-parallel size and its recorded splits (``tp_split.py``)."""
    size, splits = tensor_parallel
    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed reports progress on stdout
        if deepspeed_dir is None:
            return _PlainSource(checkpoint, param_names)
        return _ZeroSource(deepspeed_dir) if size == 1 else _TensorParallelSource(deepspeed_dir, size, splits)
