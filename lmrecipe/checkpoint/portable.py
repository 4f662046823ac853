"""The topology-free form of a checkpoint: written once when a resume changes the layout, loaded by parameter name.

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

DeepSpeed AutoEP's experts are held whole, ``[experts, ...]``, under their parameter's own name
(``model.layers.0.mlp.experts.w1``), whatever the expert-parallel size that saved them (``ep_split.py``); each rank
of the new layout takes the rows of its own experts.

Writing is spread over the ranks of the resuming run and streamed: the parameters are split into contiguous runs
of about equal bytes, one per rank, and each rank writes the files of its run (:func:`plan_shards`), one tensor at
a time, as the checkpoint's reader gives them (``readers.py``); the files' headers are known in advance (names and
shapes), so no file is ever held in memory.

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
import hashlib
import json
import logging
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import torch

from lmrecipe.checkpoint.ep_split import contiguous, experts_of, local_experts
from lmrecipe.checkpoint.readers import ParamNames, StateSource, open_source
from lmrecipe.checkpoint.tp_split import local_slice
from lmrecipe.parallel.topology import Topology
from lmrecipe.errors import fail
from lmrecipe.fileio import building_dir, write_json_atomic
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


def write_share(source: StateSource, plan: ShardPlan, folder: Path, rank: int, progress: bool = False) -> int:
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


def finish(folder: Path, plan: ShardPlan, source_steps: Mapping[str, int], *, source_layout: Topology,
           source_sha256: str) -> dict:
    """The main process, once every rank's files are written: each state's index and ``portable.json``."""
    for key in STATES:
        weight_map = {name: plan.file_name(key, i) for i, names in enumerate(plan.files) for name in names}
        total = sum(plan.nbytes(name) for name in plan.shapes)
        write_json_atomic(folder / index_file(key), {"metadata": {"total_size": total}, "weight_map": weight_map})
    meta = {
        "format_version": FORMAT_VERSION, "source_layout": source_layout.record(), "source_state_sha256": source_sha256,
        "params": {name: list(shape) for name, shape in plan.shapes.items()},
        "step": {name: int(source_steps[name]) for name in plan.shapes},
    }
    write_json_atomic(folder / META_FILE, meta)
    return meta


def convert(checkpoint: Path, dest: Path, *, deepspeed_dir: Path | None, param_names: ParamNames,
            source_layout: Topology, source_sha256: str, max_shard_bytes: int = SHARD_BYTES) -> dict:
    """Write the whole portable form of ``checkpoint`` to ``dest`` in this process (atomically: a folder built aside,
    then renamed); a resume spreads the same steps over its ranks (``resume.py``).

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


class _LocalExperts:
    """A :class:`PortableState` seen by one DeepSpeed AutoEP rank: a whole expert tensor (``[experts, ...]``) reads
    as the rows of this rank's experts (``ep_split.py``)."""

    def __init__(self, portable: PortableState, experts: Mapping[str, Sequence[int]]):
        self.portable, self.experts = portable, experts

    def name_for(self, names: Iterable[str]) -> str:
        return self.portable.name_for(names)

    def step(self, name: str) -> int:
        return self.portable.step(name)

    def get(self, key: str, name: str) -> torch.Tensor:
        whole = self.portable.get(key, name)
        return whole if name not in self.experts else experts_of(whole, self.experts[name])

    def get_flat(self, key: str, name: str, start: int, numel: int) -> torch.Tensor:
        experts = self.experts.get(name)
        if experts is None:
            return self.portable.get_flat(key, name, start, numel)
        if contiguous(experts):  # this rank's experts are one run of rows of the whole tensor
            row = math.prod(self.portable.meta["params"][name][1:])
            return self.portable.get_flat(key, name, experts[0] * row + start, numel)
        return self.get(key, name).reshape(-1)[start:start + numel]


def load_portable(folder: Path, model, optimizer, *, deepspeed: bool, step: int, samples_per_step: int,
                  tensor_parallel: tuple[Mapping[str, Mapping], int] | None = None) -> None:
    """Set weights, AdamW moments and step counts of the prepared ``model`` / ``optimizer`` from ``folder``.

    ``step`` and ``samples_per_step`` set a DeepSpeed engine's own counters as its loader would (optimizer steps
    of the run, samples seen). ``tensor_parallel``: the loading run's splits and this rank's tensor-parallel rank.
    Under DeepSpeed AutoEP each rank takes its own experts of the whole expert tensors.
    """
    portable = PortableState(folder)
    if tensor_parallel is not None:
        portable = _RankSlices(portable, *tensor_parallel)
    if deepspeed and (experts := local_experts(model.module)):
        portable = _LocalExperts(portable, experts)
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
