"""Building the Accelerator and its DeepSpeed plugin, with every "auto" value filled from the recipe.

:func:`build_runtime` derives the run's topology once: the precision, the batch layout (accumulation steps),
the filled DeepSpeed config and its :class:`ZeroSetup`; every other component receives them from it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path

import torch

from lmrecipe.config import Config
from lmrecipe.data.batches import BatchLayout
from lmrecipe.errors import fail

logger = logging.getLogger(__name__)

# Values a ds_configs/*.json may leave as "auto": each has exactly one home, the recipe.
RECIPE_OWNED = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size", "gradient_clipping")


def resolve_precision(requested: str) -> str:
    """auto = bf16 on GPUs that support it, fp16 on older GPUs, fp32 on CPUs (bf16 matmul is slower there)."""
    if requested != "auto":
        return requested
    if torch.cuda.is_available():
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return "fp32"


def world_size_from_env() -> int:
    """World size announced by the launcher (accelerate launch, torchrun, srun), before any process group exists."""
    return int(os.environ.get("WORLD_SIZE", "1"))


_DEFAULT_PERSISTENCE_THRESHOLD = 100_000  # DeepSpeed's default stage3_param_persistence_threshold


@dataclass(frozen=True)
class ZeroSetup:
    """What the rest of the code needs to know of a DeepSpeed config (``deepspeed=False``: plain DDP)."""

    stage: int = 0
    """ZeRO stage; 0 without DeepSpeed."""
    offload_optimizer: bool = False
    """Optimizer states (and fp32 gradient partitions) live in CPU memory; the update runs on the CPU."""
    offload_param: bool = False
    """ZeRO-3 weight partitions live in CPU memory."""
    persistence_threshold: int = _DEFAULT_PERSISTENCE_THRESHOLD
    """ZeRO-3 keeps parameters with at most this many elements whole on every rank."""
    deepspeed: bool = False
    """Whether the run trains under DeepSpeed at all."""

    @classmethod
    def from_ds_config(cls, ds_config: dict | None) -> "ZeroSetup":
        if ds_config is None:
            return cls()
        zero = ds_config.get("zero_optimization", {})

        def offloaded(key: str) -> bool:
            return zero.get(key, {}).get("device", "none") not in (None, "none")

        return cls(
            stage=int(zero.get("stage", 0)),
            offload_optimizer=offloaded("offload_optimizer"),
            offload_param=offloaded("offload_param"),
            persistence_threshold=int(zero.get("stage3_param_persistence_threshold", _DEFAULT_PERSISTENCE_THRESHOLD)),
            deepspeed=True,
        )

    def describe(self) -> str:
        if not self.deepspeed:
            return "no DeepSpeed"
        offload = [name for name, on in (("optimizer", self.offload_optimizer), ("params", self.offload_param)) if on]
        return f"DeepSpeed ZeRO-{self.stage}" + (f" (offload: {', '.join(offload)})" if offload else "")


@dataclass(frozen=True)
class Layout:
    """How a run cuts its optimizer state: the process count and the DeepSpeed setup. Recorded as each checkpoint's
    ``topology``; a resume on another layout goes through the topology-free form (``checkpoint/portable.py``)."""

    world_size: int
    deepspeed: bool = False
    zero_stage: int = 0
    offload_optimizer: bool = False
    offload_param: bool = False

    @classmethod
    def of_run(cls, world_size: int, zero: ZeroSetup) -> "Layout":
        return cls(world_size, zero.deepspeed, zero.stage if zero.deepspeed else 0, zero.offload_optimizer,
                   zero.offload_param)

    @classmethod
    def from_topology(cls, topology: dict) -> "Layout":
        """The layout a checkpoint's ``topology`` record describes (older records lack the offload keys)."""
        deepspeed = bool(topology["deepspeed"])
        return cls(int(topology["world_size"]), deepspeed, int(topology["zero_stage"]) if deepspeed else 0,
                   bool(topology.get("offload_optimizer", False)), bool(topology.get("offload_param", False)))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def describe(self) -> str:
        if not self.deepspeed:
            return "no DeepSpeed"
        offload = [name for name, on in (("optimizer", self.offload_optimizer), ("param", self.offload_param)) if on]
        return f"ZeRO-{self.zero_stage}" + (f" (offload {', '.join(offload)})" if offload else "")

    def changes_from(self, saved: "Layout") -> list[str]:
        """What differs from the saving layout ``saved``, in words (empty: the same)."""
        changes = []
        if saved.world_size != self.world_size:
            changes.append(f"processes {saved.world_size} -> {self.world_size}")
        if saved.describe() != self.describe():
            changes.append(f"{saved.describe()} -> {self.describe()}")
        return changes

    def needs_conversion_from(self, saved: "Layout") -> bool:
        """Whether state saved on ``saved`` cannot be loaded as it is. Without DeepSpeed on both sides the state is
        whole on every rank, so any process count loads it; DeepSpeed loads its own shards only into the same
        stage, offload and data-parallel size."""
        return (saved.deepspeed or self.deepspeed) and self.changes_from(saved) != []


def load_deepspeed_config(path: str | Path, cfg: Config, layout: BatchLayout, precision: str) -> dict:
    """Read a ds_configs JSON and fill the values the recipe owns, so none is left to guesswork."""
    try:
        ds = json.loads(Path(path).read_text())
    except json.JSONDecodeError as err:
        raise fail(f"distributed.deepspeed_config={str(path)!r} is not valid JSON: {err}.") from None
    for key in ("optimizer", "scheduler"):
        if key in ds:
            raise fail(
                f"{path} has an {key!r} section. The optimizer and schedule are built from the recipe (optim.*, "
                f"schedule.*); remove the section so each number has one home."
            )
    for key in RECIPE_OWNED:
        if key in ds and ds[key] != "auto":
            raise fail(
                f"{path} sets {key}={ds[key]!r}. Batch sizes, accumulation and clipping come from the recipe "
                f"(train.*, optim.grad_clip): write \"{key}\": \"auto\" in the JSON."
            )
    ds["train_micro_batch_size_per_gpu"] = layout.micro_batch_size
    ds["gradient_accumulation_steps"] = layout.accum_steps
    ds["train_batch_size"] = layout.global_batch_size
    ds["gradient_clipping"] = cfg.optim.grad_clip
    ds.setdefault("bf16", {})["enabled"] = precision == "bf16"
    ds.setdefault("fp16", {})["enabled"] = precision == "fp16"
    if precision != "bf16":
        # fp32 grads need no separate accumulation dtype; fp16 uses DeepSpeed's loss-scaled path.
        ds.get("data_types", {}).pop("grad_accum_dtype", None)
    ds.setdefault("steps_per_print", 2**31 - 1)  # the recipe logs; DeepSpeed's own prints are noise
    # Under offload optim.build_optimizer already returns DeepSpeedCPUAdam(adamw_mode=True). Left True, this flag
    # makes Accelerate swap it for a DeepSpeedCPUAdam(adamw_mode=False): L2 instead of decoupled weight decay.
    ds["zero_force_ds_cpu_optimizer"] = False
    return ds


def _ensure_single_process_env() -> None:
    """``python train.py`` with DeepSpeed: give torch.distributed a one-process world on localhost."""
    if "RANK" in os.environ:
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


@dataclass(frozen=True)
class Runtime:
    """The Accelerator and the topology facts derived once for the whole run."""

    accelerator: object
    precision: str
    """bf16, fp16 or fp32, resolved from ``train.precision``."""
    layout: BatchLayout
    """This rank's share of each optimizer step (accumulation steps live here)."""
    zero: ZeroSetup
    ds_config: dict | None
    """The DeepSpeed config as given to DeepSpeed, every "auto" filled; None without DeepSpeed."""


def build_runtime(cfg: Config) -> Runtime:
    """The Accelerator (and DeepSpeed plugin). Build it before the model so ZeRO-3 partitions at construction."""
    from accelerate.utils import DeepSpeedPlugin

    precision = resolve_precision(cfg.train.precision)
    if precision == "fp16" and not torch.cuda.is_available():
        raise fail("train.precision=fp16 needs a GPU; use fp32 or bf16 on a CPU.")
    world_size = world_size_from_env()
    layout = BatchLayout.from_config(cfg.train, world_size)  # fails before any process group exists
    ds_config, plugin = None, None
    ds_path = cfg.distributed.deepspeed_config_path()
    if ds_path is not None:
        ds_config = load_deepspeed_config(ds_path, cfg, layout, precision)
        _ensure_single_process_env()
        plugin = DeepSpeedPlugin(hf_ds_config=ds_config)
    accelerator = _build_accelerator(world_size, precision, layout.accum_steps, plugin, cfg.distributed.timeout_s)
    return Runtime(accelerator, precision, replace(layout, rank=accelerator.process_index),
                   ZeroSetup.from_ds_config(ds_config), ds_config)


def build_eval_accelerator():
    """A plain Accelerator (no DeepSpeed: evaluated weights are consolidated), fp32, on any number of processes."""
    return _build_accelerator(world_size_from_env(), "fp32", 1, None, 1800)


def _build_accelerator(world_size: int, precision: str, accum_steps: int, plugin, timeout_s: int):
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    # Without an accelerator, Accelerate must be told the backend or every rank believes it is rank 0.
    distributed = world_size > 1 or plugin is not None
    backend = "gloo" if distributed and not torch.cuda.is_available() else None
    handlers = [InitProcessGroupKwargs(backend=backend, timeout=timedelta(seconds=timeout_s))] if distributed else []
    accelerator = Accelerator(
        # Without cpu=True, Accelerate 1.15 on a GPU-less machine leaves several processes unsynchronised
        # (DistributedType.NO: no DDP wrapper, every rank trains alone).
        cpu=plugin is None and not torch.cuda.is_available(),
        mixed_precision={"fp32": "no"}.get(precision, precision),
        gradient_accumulation_steps=accum_steps,
        deepspeed_plugin=plugin,
        kwargs_handlers=handlers,
        step_scheduler_with_optimizer=False,
    )
    if accelerator.num_processes != world_size or (world_size > 1 and accelerator.distributed_type.value == "NO"):
        raise fail(
            f"The launcher announced WORLD_SIZE={world_size} but Accelerate formed {accelerator.num_processes} "
            "synchronised processes. Launch with `accelerate launch --multi_gpu --num_processes N SCRIPT ...` or torchrun."
        )
    return accelerator
