"""Building the Accelerator and its DeepSpeed plugin from the run's topology (:func:`build_runtime`), and the plain one
evaluation uses."""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch

from lmrecipe.config import Workload
from lmrecipe.data.batches import BatchLayout
from lmrecipe.errors import fail
from lmrecipe.observe.quiet import quiet_prints
from lmrecipe.parallel.deepspeed_config import log_op_compilation
from lmrecipe.parallel.precision import fp8_recipe
from lmrecipe.parallel.splits import SequenceParallel, _sequence_parallelism
from lmrecipe.parallel.topology import Topology, world_size_from_env


@dataclass(frozen=True)
class Runtime:
    """The Accelerator and what the run derived once for it."""

    accelerator: object
    precision: str
    """bf16, fp16 or fp32, resolved from ``train.precision``."""
    topology: Topology
    batch: BatchLayout
    """This rank's share of each optimizer step (the accumulation steps live here)."""
    ds_config: dict | None
    """The DeepSpeed config as given to DeepSpeed, every "auto" filled; None without DeepSpeed."""
    sequence: SequenceParallel | None = None
    """This rank's share of each sequence (``distributed.sequence_parallel_size`` > 1); None: whole sequences."""


def build_runtime(work: Workload, precision: str, topology: Topology, ds_config: dict | None) -> Runtime:
    """The Accelerator (and DeepSpeed plugin) of the launch that the start-up checks judged (``precision``,
    ``topology`` and the filled ``ds_config`` of :func:`~lmrecipe.parallel.launch.check_launch`). Build it before
    the model so ZeRO-3 partitions at construction."""
    from accelerate.utils import DeepSpeedPlugin

    world_size = topology.world_size
    if work.distributed.hang_watchdog and world_size > 1:
        # torch's flight recorder keeps each rank's collectives only when asked before the process group exists; the
        # hang watchdog writes it beside hang.md. A launch that sets its own size keeps it.
        os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")
    plugin = None
    if ds_config is not None:
        _ensure_single_process_env()
        plugin = DeepSpeedPlugin(hf_ds_config=ds_config)
        log_op_compilation(topology.zero.offload_optimizer)
    sp = topology.sequence_parallel_size
    parallelism = _sequence_parallelism(sp, world_size, work.data.seq_len) if sp > 1 else None
    accum_steps = topology.batch_layout(work.train).accum_steps
    with quiet_prints():  # DeepSpeed prints a line per process as it sets up its CPU collectives
        accelerator = _build_accelerator(world_size, precision, accum_steps, plugin, work.distributed.timeout_s,
                                         parallelism)
    rank = accelerator.process_index
    sequence = SequenceParallel.of_rank(sp, rank, ds_config) if sp > 1 else None
    return Runtime(accelerator, precision, topology, topology.batch_layout(work.train, rank), ds_config, sequence)


def unwrap_model(accelerator, model):
    """``accelerator.unwrap_model(model)``, without importing DeepSpeed where no engine can wrap the model: Accelerate
    imports it (about 1.2 s of CPU) only to ask whether ``model`` is one, and a run without DeepSpeed never imports it."""
    if "deepspeed" in sys.modules or isinstance(model, torch.nn.parallel.DistributedDataParallel) or \
            hasattr(model, "_orig_mod"):
        return accelerator.unwrap_model(model)
    return model


def release_distributed(accelerator=None) -> None:
    """Tear down what the run's processes share, on every rank after the last collective: the DeepSpeed engine (its
    ZeRO-3 hooks), the process groups, DeepSpeed's cached groups and Accelerate's state. The next run in the same
    process (a benchmark, an in-process test) builds its own; ``accelerator``: None after a run that failed to build."""
    import torch.distributed as dist

    if accelerator is not None:
        accelerator.free_memory()  # destroys the DeepSpeed engine (which needs the groups) and drops the model
    if dist.is_initialized():
        dist.destroy_process_group()
    if "deepspeed" in sys.modules:
        import deepspeed.comm.comm as ds_comm
        import deepspeed.utils.groups as ds_groups

        ds_comm.cdb = None
        for name in ("_EXPERT_PARALLEL_GROUP", "_EXPERT_PARALLEL_GROUP_RANKS", "_EXPERT_DATA_PARALLEL_GROUP",
                     "_EXPERT_DATA_PARALLEL_GROUP_RANKS", "_ALL_TO_ALL_GROUP"):
            setattr(ds_groups, name, {})
        for name in ("_WORLD_GROUP", "_ZERO_PARAM_INTRA_PARALLEL_GROUP", "mpu", "mesh_device",
                     "_TENSOR_MODEL_PARALLEL_GROUP", "_MODEL_PARALLEL_GROUP", "_DATA_PARALLEL_GROUP",
                     "_MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE", "_MPU_TENSOR_MODEL_PARALLEL_RANK"):
            if hasattr(ds_groups, name):
                setattr(ds_groups, name, None)
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


def _ensure_single_process_env() -> None:
    """``python train.py`` with DeepSpeed: give torch.distributed a one-process world on localhost."""
    if "RANK" in os.environ:
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def build_eval_accelerator():
    """A plain Accelerator (no DeepSpeed: evaluated weights are consolidated), fp32, on any number of processes."""
    return _build_accelerator(world_size_from_env(), "fp32", 1, None, 1800)


def _build_accelerator(world_size: int, precision: str, accum_steps: int, plugin, timeout_s: int,
                       parallelism=None):
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs, InitProcessGroupKwargs

    # Without an accelerator, Accelerate must be told the backend or every rank believes it is rank 0.
    distributed = world_size > 1 or plugin is not None
    backend = "gloo" if distributed and not torch.cuda.is_available() else None
    handlers = [InitProcessGroupKwargs(backend=backend, timeout=timedelta(seconds=timeout_s)),
                # The models' buffers (rotary frequencies) are computed alike on every rank: DDP's broadcast of them
                # before each forward is a collective per micro-batch in which every rank waits for rank 0.
                DistributedDataParallelKwargs(broadcast_buffers=False)] if distributed else []
    if precision == "fp8":
        handlers.append(fp8_recipe())
    accelerator = Accelerator(
        # Without cpu=True, Accelerate 1.15 on a GPU-less machine leaves several processes unsynchronised
        # (DistributedType.NO: no DDP wrapper, every rank trains alone).
        cpu=plugin is None and not torch.cuda.is_available(),
        mixed_precision={"fp32": "no"}.get(precision, precision),
        gradient_accumulation_steps=accum_steps,
        deepspeed_plugin=plugin,
        kwargs_handlers=handlers,
        step_scheduler_with_optimizer=False,
        parallelism_config=parallelism,
    )
    if accelerator.num_processes != world_size or (world_size > 1 and accelerator.distributed_type.value == "NO"):
        raise fail(
            f"The launcher announced WORLD_SIZE={world_size} but Accelerate formed {accelerator.num_processes} "
            "synchronised processes. Launch with `accelerate launch --multi_gpu --num_processes N SCRIPT ...` or torchrun."
        )
    return accelerator
