"""Building the Accelerator and its DeepSpeed plugin, with every "auto" value filled from the recipe."""

from __future__ import annotations

import json
import logging
import os
import socket
from datetime import timedelta
from pathlib import Path

import torch

from .config import Config
from .errors import fail

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


def load_deepspeed_config(path: str, cfg: Config, world_size: int, precision: str) -> dict:
    """Read a ds_configs JSON and fill the values the recipe owns, so none is left to guesswork."""
    try:
        ds = json.loads(Path(path).read_text())
    except json.JSONDecodeError as err:
        raise fail(f"distributed.deepspeed_config={path!r} is not valid JSON: {err}.") from None
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
    accum = cfg.train.grad_accum_steps(world_size)
    ds["train_micro_batch_size_per_gpu"] = cfg.train.micro_batch_size
    ds["gradient_accumulation_steps"] = accum
    ds["train_batch_size"] = cfg.train.global_batch_size
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


def zero_stage(ds_config: dict | None) -> int:
    return int((ds_config or {}).get("zero_optimization", {}).get("stage", 0))


def offloads_optimizer(ds_config: dict | None) -> bool:
    device = (ds_config or {}).get("zero_optimization", {}).get("offload_optimizer", {}).get("device", "none")
    return device not in (None, "none")


def _ensure_single_process_env() -> None:
    """``python train.py`` with DeepSpeed: give torch.distributed a one-process world on localhost."""
    if "RANK" in os.environ:
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def build_accelerator(cfg: Config):
    """The Accelerator (and DeepSpeed plugin). Build it before the model so ZeRO-3 partitions at construction.

    Returns ``(accelerator, ds_config_or_None, precision)``.
    """
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs

    precision = resolve_precision(cfg.train.precision)
    if precision == "fp16" and not torch.cuda.is_available():
        raise fail("train.precision=fp16 needs a GPU; use fp32 or bf16 on a CPU.")
    world_size = world_size_from_env()
    accum = cfg.train.grad_accum_steps(world_size)
    ds_config = None
    plugin = None
    if cfg.distributed.deepspeed_config is not None:
        ds_config = load_deepspeed_config(cfg.distributed.deepspeed_config, cfg, world_size, precision)
        _ensure_single_process_env()
        plugin = DeepSpeedPlugin(hf_ds_config=ds_config)
    # Without an accelerator, Accelerate must be told the backend or every rank believes it is rank 0.
    distributed = world_size > 1 or plugin is not None
    backend = "gloo" if distributed and not torch.cuda.is_available() else None
    handlers = [InitProcessGroupKwargs(backend=backend, timeout=timedelta(seconds=cfg.distributed.timeout_s))] if distributed else []
    accelerator = Accelerator(
        # Without cpu=True, Accelerate 1.15 on a GPU-less machine leaves several processes unsynchronised
        # (DistributedType.NO: no DDP wrapper, every rank trains alone).
        cpu=plugin is None and not torch.cuda.is_available(),
        mixed_precision={"fp32": "no"}.get(precision, precision),
        gradient_accumulation_steps=accum,
        deepspeed_plugin=plugin,
        kwargs_handlers=handlers,
        step_scheduler_with_optimizer=False,
    )
    if accelerator.num_processes != world_size or (world_size > 1 and accelerator.distributed_type.value == "NO"):
        raise fail(
            f"The launcher announced WORLD_SIZE={world_size} but Accelerate formed {accelerator.num_processes} "
            "processes. Launch with `accelerate launch --multi_gpu --num_processes N train.py ...` or torchrun."
        )
    return accelerator, ds_config, precision
