"""Topology-free checkpoints: resuming on another number of processes, another ZeRO stage, or without DeepSpeed.

A checkpoint keeps its optimizer state in the layout of the run that wrote it: DeepSpeed's ZeRO shards are cut
for one data-parallel size and stage (DeepSpeed #3810), and ``optimizer.bin`` (no DeepSpeed) indexes parameters
by their position in the optimizer's groups. When a resume changes that layout, the checkpoint is converted once
into a *portable* form, cached next to the checkpoint (which is never modified), and loaded into the new layout
by parameter name::

    step_XXXXXXXX.portable/
        fp32.safetensors         fp32 master weights, full tensors by parameter name
        exp_avg.safetensors      AdamW first moments, same names and shapes
        exp_avg_sq.safetensors   AdamW second moments
        portable.json            AdamW step count per parameter, the source layout, the source state's sha256

Reading: DeepSpeed shards are consolidated by DeepSpeed's own reconstruction (``zero_to_fp32``, the code behind
``get_fp32_state_dict_from_zero_checkpoint``), applied to the fp32 partitions and to each moment's partitions,
which share their layout; ``optimizer.bin`` is read with the tensors-only unpickler and named from the
optimizer's groups. Writing into the new layout: without DeepSpeed, weights are copied into the parameters and
the moments go through the optimizer's own ``load_state_dict``; under ZeRO-1/2/3 (and offload), each rank takes
its own fragment of every full tensor through DeepSpeed's tensor-fragment API (``safe_set_full_fp32_param``,
``safe_set_full_optimizer_state``), then the training-precision weights are refreshed from the fp32 masters.
Each rank reads one parameter at a time from memory-mapped safetensors files, so no rank holds the whole state.

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
import sys
import time
from pathlib import Path
from typing import Iterable, Sequence

import torch

from lmrecipe.distributed import Layout
from lmrecipe.errors import fail
from lmrecipe.fileio import building_dir, write_json_atomic
from lmrecipe.model import bare_parameter_name
from lmrecipe.optim import names_by_param

logger = logging.getLogger(__name__)

PORTABLE_SUFFIX = ".portable"
META_FILE = "portable.json"
STATES = ("fp32", "exp_avg", "exp_avg_sq")
"""One safetensors file per state: the fp32 weights and AdamW's two moments."""
MOMENTS = ("exp_avg", "exp_avg_sq")
FORMAT_VERSION = 1

ParamNames = Sequence[Sequence[str]]
"""Every parameter of the optimizer in its order (group by group), each with all the names it goes by (a tied
weight has several)."""


# --------------------------------------------------------------------------------------------------
# Layouts


# --------------------------------------------------------------------------------------------------
# Converting a checkpoint (main process)


def portable_dir(checkpoint: Path, root: Path | None = None) -> Path:
    """Where the portable form of ``checkpoint`` is cached: beside it, or in ``root`` when given."""
    return (root or checkpoint.parent) / f"{checkpoint.name}{PORTABLE_SUFFIX}"


def state_sha256(checkpoint: Path, state_file: str) -> str:
    return hashlib.sha256((checkpoint / state_file).read_bytes()).hexdigest()


def cached_portable(dest: Path, source_sha256: str) -> bool:
    """Whether ``dest`` holds a complete conversion of the checkpoint whose state has ``source_sha256``."""
    try:
        meta = json.loads((dest / META_FILE).read_text())
    except (OSError, ValueError):
        return False
    return (meta.get("format_version") == FORMAT_VERSION and meta.get("source_state_sha256") == source_sha256
            and all((dest / f"{key}.safetensors").is_file() for key in STATES))


def convert(checkpoint: Path, dest: Path, *, deepspeed_dir: Path | None, param_names: ParamNames,
            source_layout: Layout, source_sha256: str) -> dict:
    """Write the portable form of ``checkpoint`` to ``dest`` (atomically: a folder built aside, then renamed).

    Args:
        deepspeed_dir: the folder of the checkpoint's ZeRO shards, or None for a checkpoint without DeepSpeed
            (``model.safetensors`` + ``optimizer.bin``).
        param_names: the optimizer's parameters in order, with their names (names ``optimizer.bin`` by index).
        source_layout, source_sha256: recorded in ``portable.json``; the sha256 of the checkpoint's state file
            identifies the checkpoint the cache belongs to.

    Returns the contents of ``portable.json``.
    """
    start = time.perf_counter()
    if deepspeed_dir is not None:
        states, steps = _read_zero(deepspeed_dir)
    else:
        states, steps = _read_plain(checkpoint, param_names)
    meta = {
        "format_version": FORMAT_VERSION, "source_layout": source_layout.to_dict(), "source_state_sha256": source_sha256,
        "params": {name: list(t.shape) for name, t in states["fp32"].items()}, "step": steps,
    }
    from safetensors.torch import save_file

    with building_dir(dest, overwrite=True) as tmp:
        for key in STATES:
            save_file({name: t.contiguous() for name, t in states.pop(key).items()}, tmp / f"{key}.safetensors")
        write_json_atomic(tmp / META_FILE, meta)
    size_mb = sum(f.stat().st_size for f in dest.iterdir()) / 1e6
    logger.info("Converted %s to its topology-free form %s (%d parameters, %.1f MB, %.1f s)",
                checkpoint, dest, len(meta["params"]), size_mb, time.perf_counter() - start)
    return meta


def _read_plain(checkpoint: Path, param_names: ParamNames) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, int]]:
    """Weights from ``model.safetensors``; moments and steps from ``optimizer.bin``, named by optimizer position."""
    from safetensors.torch import load_file

    weights = {bare_parameter_name(name): tensor for name, tensor in load_file(checkpoint / "model.safetensors").items()}
    optim = torch.load(checkpoint / "optimizer.bin", map_location="cpu", weights_only=True)
    order = [index for group in optim["param_groups"] for index in group["params"]]
    if len(order) != len(param_names):
        raise fail(f"{checkpoint / 'optimizer.bin'} holds {len(order)} parameters but the model has {len(param_names)}: "
                   "the checkpoint belongs to another model.")
    states: dict[str, dict[str, torch.Tensor]] = {key: {} for key in STATES}
    steps = {}
    for index, names in zip(order, param_names):
        name = names[0]
        found = next((n for n in names if n in weights), None)
        if found is None:
            raise fail(f"{checkpoint / 'model.safetensors'} has no weight named {' or '.join(names)}.")
        states["fp32"][name] = weights[found].float()
        entry = optim["state"].get(index)
        if entry is None:  # never stepped (the checkpoint of step 0): fresh moments
            entry = {"step": 0, "exp_avg": torch.zeros_like(weights[found]), "exp_avg_sq": torch.zeros_like(weights[found])}
        for key in MOMENTS:
            states[key][name] = entry[key].float()
        steps[name] = int(torch.as_tensor(entry["step"]).item())
    return states, steps


def _read_zero(ds_dir: Path) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, int]]:
    """Consolidate ZeRO-1/2/3 shards: fp32 weights and both moments by name, with DeepSpeed's reconstruction."""
    from deepspeed.utils import zero_to_fp32 as z

    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed reports progress on stdout
        model_states = z.parse_model_states(z.get_model_state_files(str(ds_dir)))
        shards = [torch.load(f, map_location="cpu", mmap=True, weights_only=False)["optimizer_state_dict"]
                  for f in z.get_optim_files(str(ds_dir))]
    stage = int(shards[0]["zero_stage"])
    world_size = shards[0]["partition_count"]
    world_size = max(world_size) if isinstance(world_size, list) else int(world_size)
    if len(shards) != world_size:
        raise fail(f"{ds_dir} holds {len(shards)} optimizer shards for a world size of {world_size}: it is incomplete.")
    if stage <= 2:
        flat = [s["single_partition_of_fp32_groups"] for s in shards]
        inner = [s["base_optimizer_state"]["state"] for s in shards]
    else:
        flat = [s["fp32_flat_groups"] for s in shards]
        inner = [s["optimizer_state_dict"]["state"] for s in shards]
    n_groups = len(flat[0])
    partitions = {"fp32": flat, **{key: [[rank[g][key] for g in range(n_groups)] for rank in inner] for key in MOMENTS}}
    names = set().union(*(shapes.keys() for shapes in model_states[0].param_shapes))
    states = {}
    with contextlib.redirect_stdout(sys.stderr):
        for key, groups in partitions.items():
            if stage <= 2:
                full = z._get_fp32_state_dict_from_zero2_checkpoint(
                    world_size, groups, model_states, False, shards[0].get("param_alignment_paddings"))
            else:
                full = z.to_torch_tensor(z._get_fp32_state_dict_from_zero3_checkpoint(world_size, groups, model_states, False))
            # Owned copies: ZeRO-1/2 consolidation returns views of one flat buffer per group.
            states[key] = {name: t.float().clone() for name, t in full.items() if name in names}
    steps = {}
    for group, shapes in enumerate(model_states[0].param_shapes):
        step = int(torch.as_tensor(inner[0][group]["step"]).item())
        steps.update({name: step for name in shapes})
    return states, steps


# --------------------------------------------------------------------------------------------------
# Loading the portable form into a prepared model and optimizer (every rank)


class PortableState:
    """The portable files of one checkpoint, read one tensor at a time (memory-mapped)."""

    def __init__(self, folder: Path):
        from safetensors import safe_open

        self.folder = folder
        self.meta = json.loads((folder / META_FILE).read_text())
        self._stack = contextlib.ExitStack()
        self._files = {key: self._stack.enter_context(safe_open(folder / f"{key}.safetensors", framework="pt"))
                       for key in STATES}

    def close(self) -> None:
        self._stack.close()

    def name_for(self, names: Iterable[str]) -> str:
        for name in names:
            if name in self.meta["params"]:
                return name
        raise fail(f"The checkpoint holds no parameter named {' or '.join(names)}: it belongs to another model.")

    def get(self, key: str, name: str) -> torch.Tensor:
        return self._files[key].get_tensor(name)

    def step(self, name: str) -> int:
        return int(self.meta["step"][name])


def load_portable(folder: Path, model, optimizer, *, deepspeed: bool, step: int, samples_per_step: int) -> None:
    """Set weights, AdamW moments and step counts of the prepared ``model`` / ``optimizer`` from ``folder``.

    ``step`` and ``samples_per_step`` set a DeepSpeed engine's own counters as its loader would (optimizer steps
    of the run, samples seen).
    """
    portable = PortableState(folder)
    try:
        if deepspeed:
            _load_zero(portable, model, step, samples_per_step)
        else:
            _load_plain(portable, model, optimizer)
    finally:
        portable.close()


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
def _load_zero(portable: PortableState, engine, run_step: int, samples_per_step: int) -> None:
    """ZeRO-1/2/3: fresh AdamW state on this rank's flat partitions, then each rank takes its fragments."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

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
        name = portable.name_for(names[id(param)])
        safe_set_full_fp32_param(param, portable.get("fp32", name))
        for key in MOMENTS:
            safe_set_full_optimizer_state(param, portable.get(key, name), key)
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
