"""Topology-free checkpoints: resuming on another number of processes, another ZeRO stage, or without DeepSpeed.

A checkpoint keeps its optimizer state in the layout of the run that wrote it: DeepSpeed's ZeRO shards are cut
for one data-parallel size and stage (DeepSpeed #3810), and ``optimizer.bin`` (no DeepSpeed) indexes parameters
by their position in the optimizer's groups. When a resume changes that layout, the checkpoint is converted once
into a *portable* form, cached next to the checkpoint (which is never modified), and loaded into the new layout
by parameter name. Per state (the fp32 weights and AdamW's two moments), a sharded safetensors set with a Hugging
Face style index::

    step_XXXXXXXX.portable/
        fp32.safetensors.index.json       {"metadata": {"total_size": ...}, "weight_map": {name: file}}
        fp32-00001-of-00004.safetensors   full fp32 tensors by parameter name, at most SHARD_BYTES a file
        exp_avg.safetensors.index.json, exp_avg-0000K-of-0000N.safetensors         AdamW first moments, same split
        exp_avg_sq.safetensors.index.json, exp_avg_sq-0000K-of-0000N.safetensors   AdamW second moments
        portable.json    format version, AdamW step count and shape per parameter, the source layout and state sha256

Writing is spread over the ranks of the resuming run and streamed: the parameters are split into contiguous runs
of about equal bytes, one per rank, and each rank writes the files of its run (:func:`plan_shards`), one tensor at
a time: a parameter's state is consolidated from the source, appended to its file, and dropped. The files' headers
are known in advance (names and shapes), so no file is ever held in memory. DeepSpeed's ZeRO-1/2/3 shards are
memory-mapped and read fragment by fragment with the offsets of DeepSpeed's own reconstruction (``zero_to_fp32``);
``optimizer.bin`` is read with the tensors-only unpickler (memory-mapped too) and named from the optimizer's
groups. A rank's memory holds one full tensor at a time, whatever the model's size.

Reading into the new layout: without DeepSpeed, weights are copied into the parameters and the moments go through
the optimizer's own ``load_state_dict``; under ZeRO-3 (and offload), each rank takes its partition of every full
tensor through DeepSpeed's tensor-fragment API (``safe_set_full_fp32_param``, ``safe_set_full_optimizer_state``);
under ZeRO-1/2 each rank reads, by name with safetensors' lazy ``safe_open``, only the rows that hold its own
fragments, and skips the parameters it holds none of. Then the training-precision weights are refreshed from
the fp32 masters.

A cache in the form of earlier code (format 1: one file per state) is not read: the checkpoint is converted again
and the cache replaced.

Why not DeepSpeed's universal checkpoints: ``ds_to_universal`` needs ``--inject_missing_state`` for checkpoints
written through Accelerate, its loader (``load_universal``) has failed on Accelerate/Trainer layouts (DeepSpeed
#5405, transformers #33157), and neither covers a move to or from a run without DeepSpeed. The form above is
plain safetensors by name, readable by anything.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import logging
import math
import mmap
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import torch

from lmrecipe.checkpoint.tp_split import full_shape, local_slice, merge
from lmrecipe.distributed import Layout
from lmrecipe.errors import fail
from lmrecipe.fileio import building_dir, write_json_atomic
from lmrecipe.model import bare_parameter_name
from lmrecipe.optim import names_by_param

logger = logging.getLogger(__name__)

PORTABLE_SUFFIX = ".portable"
META_FILE = "portable.json"
STATES = ("fp32", "exp_avg", "exp_avg_sq")
"""One sharded safetensors set per state: the fp32 weights and AdamW's two moments."""
MOMENTS = ("exp_avg", "exp_avg_sq")
FORMAT_VERSION = 2
"""1: one whole safetensors file per state, written by the main process (not read: converted again)."""
SHARD_BYTES = 2 << 30
"""Largest file of a state (a larger single tensor gets a file of its own), as Hugging Face shards weights."""
_BYTES_PER_VALUE = 4  # every state is stored in fp32
_CHUNK_VALUES = 1 << 22
"""Values copied from a memory-mapped shard before its pages are released (16 MB of fp32)."""

ParamNames = Sequence[Sequence[str]]
"""Every parameter of the optimizer in its order (group by group), each with all the names it goes by (a tied
weight has several)."""


def index_file(key: str) -> str:
    return f"{key}.safetensors.index.json"


def portable_dir(checkpoint: Path, root: Path | None = None) -> Path:
    """Where the portable form of ``checkpoint`` is cached: beside it, or in ``root`` when given."""
    return (root or checkpoint.parent) / f"{checkpoint.name}{PORTABLE_SUFFIX}"


def state_sha256(checkpoint: Path, state_file: str) -> str:
    return hashlib.sha256((checkpoint / state_file).read_bytes()).hexdigest()


def cached_portable(dest: Path, source_sha256: str) -> bool:
    """Whether ``dest`` holds a complete conversion of the checkpoint whose state has ``source_sha256``."""
    try:
        meta = json.loads((dest / META_FILE).read_text())
        files = {file for key in STATES for file in json.loads((dest / index_file(key)).read_text())["weight_map"].values()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False
    return (meta.get("format_version") == FORMAT_VERSION and meta.get("source_state_sha256") == source_sha256
            and all((dest / file).is_file() for file in files))


def stale_form(dest: Path) -> bool:
    """Whether ``dest`` holds a topology-free form written by earlier code (another format version)."""
    try:
        return json.loads((dest / META_FILE).read_text()).get("format_version") != FORMAT_VERSION
    except (OSError, ValueError, AttributeError):
        return False


# --------------------------------------------------------------------------------------------------
# Which rank writes which parameters, in which file


@dataclass(frozen=True)
class ShardPlan:
    """The files of each state: the parameters of each file in order, and the rank that writes it."""

    shapes: dict[str, tuple[int, ...]]
    files: tuple[tuple[str, ...], ...]
    writers: tuple[int, ...]

    def file_name(self, key: str, index: int) -> str:
        return f"{key}-{index + 1:05d}-of-{len(self.files):05d}.safetensors"

    def files_of(self, rank: int) -> list[int]:
        return [i for i, writer in enumerate(self.writers) if writer == rank]

    def nbytes(self, name: str) -> int:
        return _BYTES_PER_VALUE * math.prod(self.shapes[name])


def plan_shards(shapes: Mapping[str, Sequence[int]], ranks: int, max_bytes: int = SHARD_BYTES) -> ShardPlan:
    """Split the parameters (in ``shapes``' order) into ``ranks`` contiguous runs of about equal bytes, and each run
    into files of at most ``max_bytes``. Every rank computes the same plan from the same shapes."""
    shapes = {name: tuple(int(d) for d in shape) for name, shape in shapes.items()}
    sizes = {name: _BYTES_PER_VALUE * math.prod(shape) for name, shape in shapes.items()}
    total = max(sum(sizes.values()), 1)
    files: list[list[str]] = []
    writers: list[int] = []
    file_bytes = done = 0
    for name, size in sizes.items():
        writer = min(ranks - 1, done * ranks // total)  # the run this parameter's first byte falls in
        if not files or writers[-1] != writer or (file_bytes + size > max_bytes and file_bytes > 0):
            files.append([])
            writers.append(writer)
            file_bytes = 0
        files[-1].append(name)
        file_bytes += size
        done += size
    return ShardPlan(shapes, tuple(tuple(f) for f in files), tuple(writers))


# --------------------------------------------------------------------------------------------------
# Reading the checkpoint one tensor at a time


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
    """ZeRO-1/2/3 shards, read one parameter's state at a time with DeepSpeed's reconstruction offsets."""

    def __init__(self, ds_dir: Path, mp_rank: int | None = None):
        """``mp_rank``: read only the files of this tensor-parallel rank (None: a checkpoint without tensor
        parallelism)."""
        from deepspeed.utils import zero_to_fp32 as z

        if mp_rank is None:
            model_file = Path(z.get_model_state_files(str(ds_dir))[0])
            optim_files = [Path(f) for f in z.get_optim_files(str(ds_dir))]
        else:
            model_file = ds_dir / f"mp_rank_{mp_rank:02d}_model_states.pt"
            optim_files = [Path(f) for f in z.get_optim_files(str(ds_dir)) if f"_mp_rank_{mp_rank:02d}_" in Path(f).name]
            if not model_file.is_file() or not optim_files:
                raise fail(f"{ds_dir} lacks the files of tensor-parallel rank {mp_rank} ({model_file.name}, "
                           f"*_mp_rank_{mp_rank:02d}_optim_states.pt): the checkpoint is incomplete.")
        model_state = _load_mapped(model_file, weights_only=False)  # its module weights stay unread
        param_shapes = [dict(group) for group in model_state["param_shapes"]]
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
        self.shapes = {name: tuple(shape) for group in param_shapes for name, shape in group.items()}
        self.steps = {name: int(torch.as_tensor(inner[0][g]["step"]).item())
                      for g, group in enumerate(param_shapes) for name in group}
        self.where = (self._zero2_offsets(param_shapes, shards[0].get("param_alignment_paddings")) if self.stage <= 2
                      else self._zero3_offsets())

    def _zero2_offsets(self, param_shapes: list[dict], paddings) -> dict[str, tuple[int, int]]:
        """(group, offset in the group's ranks' partitions laid end to end), as ``_zero2_merge_trainable_params``."""
        where = {}
        for group, shapes in enumerate(param_shapes):
            offset = 0
            for i, (name, shape) in enumerate(shapes.items()):
                where[name] = (group, offset)
                offset += math.prod(shape) + (paddings[group][i] if paddings is not None else 0)
            align = 2 * self.world_size
            avail = sum(rank[group].numel() for rank in self.flat)
            if align * math.ceil(offset / align) != align * math.ceil(avail / align):
                raise fail(f"The ZeRO shards' group {group} holds {avail} values where its parameters take {offset}: "
                           "the checkpoint was written by different code.")
        return where

    def _zero3_offsets(self) -> dict[str, tuple[int, int]]:
        """(offset in each rank's partitions laid end to end, values per rank), as ``_zero3_merge_trainable_params``."""
        where, offset = {}, 0
        for name, shape in self.shapes.items():
            per_rank = math.ceil(math.prod(shape) / self.world_size)
            where[name] = (offset, per_rank)
            offset += per_rank
        avail = sum(flat.numel() for flat in self.flat[0])
        if offset != avail:
            raise fail(f"The ZeRO-3 shards hold {avail} values per rank where the parameters take {offset}: the "
                       "checkpoint was written by different code.")
        return where

    def _partitions(self, rank: int, key: str) -> list[torch.Tensor]:
        if key == "fp32":
            return list(self.flat[rank])
        return [self.inner[rank][g][key] for g in range(len(self.flat[rank]))]

    def read(self, key: str, name: str) -> torch.Tensor:
        shape = self.shapes[name]
        out = torch.empty(math.prod(shape), dtype=torch.float32)
        if self.stage <= 2:
            group, offset = self.where[name]
            _copy_range([self._partitions(r, key)[group] for r in range(self.world_size)], offset, out, self.release)
        else:
            offset, per_rank = self.where[name]
            for rank in range(self.world_size):
                dst = out[rank * per_rank:(rank + 1) * per_rank]  # the last rank's piece ends with padding
                if dst.numel():
                    _copy_range(self._partitions(rank, key), offset, dst, self.release)
        return out.view(shape)

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
                tensor_parallel: tuple[int, Mapping[str, Mapping]] = (1, {})):
    """The checkpoint's state, readable one parameter at a time: ``shapes`` and ``steps`` by name, ``read(key,
    name)`` a full fp32 tensor, ``close()``. ``deepspeed_dir``: the folder of its ZeRO shards, or None for a
    checkpoint without DeepSpeed, whose ``optimizer.bin`` ``param_names`` names by position. ``tensor_parallel``:
    the saving run's tensor-parallel size and its recorded splits (``tp_split.py``)."""
    size, splits = tensor_parallel
    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed reports progress on stdout
        if deepspeed_dir is None:
            return _PlainSource(checkpoint, param_names)
        return _ZeroSource(deepspeed_dir) if size == 1 else _TensorParallelSource(deepspeed_dir, size, splits)


# --------------------------------------------------------------------------------------------------
# Writing the portable form: each rank its files, then the main process the indexes


class _StreamedSafetensors:
    """A safetensors file written one tensor at a time: the header (names, shapes, offsets) first, then the data in
    that order, so the file is never in memory."""

    def __init__(self, path: Path, names: Sequence[str], plan: ShardPlan):
        header, offset = {}, 0
        for name in names:
            size = plan.nbytes(name)
            header[name] = {"dtype": "F32", "shape": list(plan.shapes[name]), "data_offsets": [offset, offset + size]}
            offset += size
        header["__metadata__"] = {"format": "pt"}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        self.pending = list(reversed(names))
        self.fh = open(path, "wb")
        self.fh.write(len(raw).to_bytes(8, "little") + raw)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self.pending.pop() != name:
            raise RuntimeError(f"{name} written out of the header's order")
        self.fh.write(memoryview(tensor.detach().to(torch.float32).contiguous().numpy()).cast("B"))

    def close(self) -> None:
        self.fh.close()


def write_share(source, plan: ShardPlan, folder: Path, rank: int, progress: bool = False) -> int:
    """Write rank ``rank``'s files of ``plan`` into ``folder``, one parameter and state at a time; return the bytes."""
    from tqdm.auto import tqdm

    mine = plan.files_of(rank)
    total = sum(plan.nbytes(name) for i in mine for name in plan.files[i]) * len(STATES)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="topology-free form",
               disable=not (progress and sys.stderr.isatty()))
    with contextlib.ExitStack() as stack:
        for i in mine:
            files = {key: _StreamedSafetensors(folder / plan.file_name(key, i), plan.files[i], plan) for key in STATES}
            for file in files.values():
                stack.callback(file.close)
            for name in plan.files[i]:
                for key in STATES:
                    files[key].write(name, source.read(key, name))  # the one tensor this process holds
                    bar.update(plan.nbytes(name))
    bar.close()
    return total


def finish(folder: Path, plan: ShardPlan, source_steps: Mapping[str, int], *, source_layout: Layout,
           source_sha256: str) -> dict:
    """The main process, once every rank's files are written: each state's index and ``portable.json``."""
    for key in STATES:
        weight_map = {name: plan.file_name(key, i) for i, names in enumerate(plan.files) for name in names}
        total = sum(plan.nbytes(name) for name in plan.shapes)
        write_json_atomic(folder / index_file(key), {"metadata": {"total_size": total}, "weight_map": weight_map})
    meta = {
        "format_version": FORMAT_VERSION, "source_layout": source_layout.to_dict(), "source_state_sha256": source_sha256,
        "params": {name: list(shape) for name, shape in plan.shapes.items()},
        "step": {name: int(source_steps[name]) for name in plan.shapes},
    }
    write_json_atomic(folder / META_FILE, meta)
    return meta


def convert(checkpoint: Path, dest: Path, *, deepspeed_dir: Path | None, param_names: ParamNames,
            source_layout: Layout, source_sha256: str, max_shard_bytes: int = SHARD_BYTES) -> dict:
    """Write the whole portable form of ``checkpoint`` to ``dest`` in this process (atomically: a folder built aside,
    then renamed); a run spreads the same steps over its ranks (``Checkpointer``).

    Args:
        deepspeed_dir: the folder of the checkpoint's ZeRO shards, or None for a checkpoint without DeepSpeed
            (``model.safetensors`` + ``optimizer.bin``).
        param_names: the optimizer's parameters in order, with their names (names ``optimizer.bin`` by index).
        source_layout, source_sha256: recorded in ``portable.json``; the sha256 of the checkpoint's state file
            identifies the checkpoint the cache belongs to.

    Returns the contents of ``portable.json``.
    """
    start = time.perf_counter()
    source = open_source(checkpoint, deepspeed_dir=deepspeed_dir, param_names=param_names)
    try:
        plan = plan_shards(source.shapes, 1, max_shard_bytes)
        with building_dir(dest, overwrite=True) as tmp:
            size = write_share(source, plan, tmp, 0, progress=True)
            meta = finish(tmp, plan, source.steps, source_layout=source_layout, source_sha256=source_sha256)
    finally:
        source.close()
    logger.info("Converted %s to its topology-free form %s (%d parameters, %.1f MB, %.1f s)",
                checkpoint, dest, len(meta["params"]), size / 1e6, time.perf_counter() - start)
    return meta


# --------------------------------------------------------------------------------------------------
# Loading the portable form into a prepared model and optimizer (every rank)


class PortableState:
    """The portable files of one checkpoint, read by name one tensor (or one tensor's rows) at a time."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.meta = json.loads((folder / META_FILE).read_text())
        self.weight_map = {key: json.loads((folder / index_file(key)).read_text())["weight_map"] for key in STATES}

    def name_for(self, names: Iterable[str]) -> str:
        for name in names:
            if name in self.meta["params"]:
                return name
        raise fail(f"The checkpoint holds no parameter named {' or '.join(names)}: it belongs to another model.")

    def get(self, key: str, name: str) -> torch.Tensor:
        from safetensors import safe_open

        # One open per tensor: closing the file unmaps the pages just read, so they do not pile up in this process.
        with safe_open(self.folder / self.weight_map[key][name], framework="pt") as fh:
            return fh.get_tensor(name)

    def get_flat(self, key: str, name: str, start: int, numel: int) -> torch.Tensor:
        """Elements ``[start, start + numel)`` of the flattened tensor, reading only the rows that hold them."""
        from safetensors import safe_open

        shape = self.meta["params"][name]
        row = math.prod(shape[1:]) if len(shape) > 1 else 1
        first, last = start // row, -(-(start + numel) // row)
        with safe_open(self.folder / self.weight_map[key][name], framework="pt") as fh:
            rows = fh.get_slice(name)[first:last]
        return rows.reshape(-1)[start - first * row:start - first * row + numel]

    def step(self, name: str) -> int:
        return int(self.meta["step"][name])


class _RankSlices:
    """A :class:`PortableState` seen by one tensor-parallel rank: a split parameter reads as this rank's slice."""

    def __init__(self, portable: PortableState, splits: Mapping[str, Mapping], rank: int):
        self.portable, self.splits, self.rank = portable, splits, rank

    def name_for(self, names: Iterable[str]) -> str:
        return self.portable.name_for(names)

    def step(self, name: str) -> int:
        return self.portable.step(name)

    def get(self, key: str, name: str) -> torch.Tensor:
        return local_slice(self.portable.get(key, name), self.splits.get(name), self.rank)

    def get_flat(self, key: str, name: str, start: int, numel: int) -> torch.Tensor:
        if name not in self.splits:
            return self.portable.get_flat(key, name, start, numel)
        return self.get(key, name).reshape(-1)[start:start + numel]


def load_portable(folder: Path, model, optimizer, *, deepspeed: bool, step: int, samples_per_step: int,
                  tensor_parallel: tuple[Mapping[str, Mapping], int] | None = None) -> None:
    """Set weights, AdamW moments and step counts of the prepared ``model`` / ``optimizer`` from ``folder``.

    ``step`` and ``samples_per_step`` set a DeepSpeed engine's own counters as its loader would (optimizer steps
    of the run, samples seen). ``tensor_parallel``: the loading run's splits and this rank's tensor-parallel rank.
    """
    portable = PortableState(folder)
    if tensor_parallel is not None:
        portable = _RankSlices(portable, *tensor_parallel)
    if deepspeed:
        _load_zero(portable, model, step, samples_per_step)
    else:
        _load_plain(portable, model, optimizer)


@torch.no_grad()
def _load_plain(portable: PortableState, module, optimizer) -> None:
    """Without DeepSpeed: copy the weights; give the moments to the optimizer's own ``load_state_dict``."""
    names = names_by_param(module)
    for param in module.parameters():
        param.copy_(portable.get("fp32", portable.name_for(names[id(param)])))
    inner = getattr(optimizer, "optimizer", optimizer)  # Accelerate's wrapper
    state, index = {}, 0
    for group in inner.param_groups:
        for param in group["params"]:
            name = portable.name_for(names[id(param)])
            state[index] = {"step": torch.tensor(float(portable.step(name)))}
            state[index].update({key: portable.get(key, name) for key in MOMENTS})
            index += 1
    payload = inner.state_dict()
    payload["state"] = state
    inner.load_state_dict(payload)  # casts and places moments and steps as this optimizer keeps them


@torch.no_grad()
def _set_fragments(portable: PortableState, param, name: str, stage: int) -> None:
    """This rank's part of ``param``'s fp32 master and moments. ZeRO-1/2: only the rows of its fragment are read (a
    parameter it holds no fragment of is skipped); ZeRO-3: the full tensors, through the tensor-fragment API."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    if stage <= 2:
        mapping = getattr(param, "_hp_mapping", None)
        if mapping is None:
            return
        address = mapping.lp_fragment_address
        for key in STATES:
            value = portable.get_flat(key, name, address.start, address.numel)
            mapping.get_hp_fragment(None if key == "fp32" else key).data.copy_(value)
        return
    safe_set_full_fp32_param(param, portable.get("fp32", name))
    for key in MOMENTS:
        safe_set_full_optimizer_state(param, portable.get(key, name), key)


@torch.no_grad()
def _load_zero(portable: PortableState, engine, run_step: int, samples_per_step: int) -> None:
    """ZeRO-1/2/3: fresh AdamW state on this rank's flat partitions, then each rank takes its fragments."""
    zero = engine.optimizer
    stage = engine.zero_optimization_stage()
    if getattr(zero, "swap_optimizer", False) or getattr(zero, "params_in_nvme_and_cpu", False):
        raise fail("Resuming on another layout into ZeRO-3 with NVMe offload is not supported; resume with the "
                   "checkpoint's layout, or offload to cpu.")
    module = engine.module
    names = names_by_param(module)
    steps = {portable.step(portable.name_for(n)) for n in names.values()}
    if len(steps) != 1:
        raise fail(f"The checkpoint's parameters have different AdamW step counts ({sorted(steps)}); DeepSpeed "
                   "keeps one per parameter group, so this state cannot be loaded into ZeRO.")
    step = steps.pop()
    base = zero.optimizer
    counts_as_int = type(base).__name__ == "DeepSpeedCPUAdam"  # CPU Adam counts steps in a Python int
    if stage == 3:
        zero.checkpoint_event_prologue()  # every parameter partitioned
        flats = zero.fp32_partitioned_groups_flat
    else:
        flats = zero.single_partition_of_fp32_groups
    for flat in flats:
        base.state[flat] = {"step": step if counts_as_int else torch.tensor(float(step)),
                            **{key: torch.zeros_like(flat) for key in MOMENTS}}
    if stage <= 2:
        zero._hp_optimizer_states_linked = False
        zero._lazy_init_hp_params_optimizer_state()  # point each parameter's fragment at the new moments
    for param in module.parameters():
        _set_fragments(portable, param, portable.name_for(names[id(param)]), stage)
    if stage <= 2:
        zero.update_lp_params()  # training-precision weights from the fp32 masters (an all-gather)
    else:
        # As DeepSpeed's own universal loader does: masters -> partitioned training-precision weights.
        for i, flat in enumerate(zero.fp32_partitioned_groups_flat):
            if flat.numel() > 0:
                zero.fp16_partitioned_groups_flat[i].data.copy_(flat.data)
        for i, flat in enumerate(zero.fp16_partitioned_groups_flat):
            for partitioned, value in zip(zero.fp16_partitioned_groups[i],
                                          zero.unflatten(flat, zero.fp16_partitioned_groups[i])):
                partitioned.data = value.data
        zero.checkpoint_event_epilogue()  # persistent parameters gathered again
    engine.global_steps = run_step
    engine.global_samples = run_step * samples_per_step
