"""The DeepSpeed config a run trains with: a ``ds_configs`` JSON holds the systems knobs, and every value the recipe owns
(batch sizes, accumulation, clipping, the parallel splits) is filled from the recipe, so each number has one home.
Also the DeepSpeed ops compiled ahead of the first run."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

from lmrecipe.config import DistributedConfig, OptimConfig
from lmrecipe.data.batches import BatchLayout
from lmrecipe.errors import fail
from lmrecipe.parallel.topology import ZeroSetup

logger = logging.getLogger(__name__)


# Values a ds_configs/*.json may leave as "auto": each has exactly one home, the recipe.
RECIPE_OWNED = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size", "gradient_clipping")


# Parallel splits a ds_configs/*.json must not carry, with the recipe's own setting for each (None: none yet). The
# recipe writes the first two from its keys; the ranks' data, batch check and checkpoint layout follow those keys.
RECIPE_PARALLELISM = {
    "sequence_parallel_size": "distributed.sequence_parallel_size",
    "tensor_parallel": "distributed.tensor_parallel_size",
}


# The keys of DeepSpeed AutoEP's ``expert_parallel`` section a ds_configs/*.json may set: how the all-to-alls and the
# expert matmuls run. ``enabled`` and ``autoep_size`` come from the recipe (distributed.expert_layer,
# distributed.expert_parallel_size), the routing from the model's own config; AutoEP's ``load_balance_coeff`` is not
# supported (the router's auxiliary loss is model.router_aux_loss_coef's).
AUTOEP_SYSTEMS_KEYS = ("comm_backend", "use_grouped_mm", "disable_triton_grouped_mm", "combine_impl",
                       "row_weighting_impl", "gate_up_impl", "async_split_plan", "comm_num_sm", "comm_qp_margin",
                       "comm_max_tokens_per_rank")


def load_deepspeed_config(path: str | Path, optim: OptimConfig, distributed: DistributedConfig, layout: BatchLayout,
                          precision: str) -> dict:
    """Read a ds_configs JSON and fill the values the recipe owns (``optim.grad_clip``, the batch ``layout``, the
    parallel splits), so none is left to guesswork."""
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
    _refuse_parallelism_sections(ds, path)
    for key in RECIPE_OWNED:
        if key in ds and ds[key] != "auto":
            raise fail(
                f"{path} sets {key}={ds[key]!r}. Batch sizes, accumulation and clipping come from the recipe "
                f"(train.*, optim.grad_clip): write \"{key}\": \"auto\" in the JSON."
            )
    ds["train_micro_batch_size_per_gpu"] = layout.micro_batch_size
    ds["gradient_accumulation_steps"] = layout.accum_steps
    # DeepSpeed counts every rank in its batch check, the tensor-parallel ranks (which read the same samples) too.
    ds["train_batch_size"] = layout.global_batch_size * distributed.tensor_parallel_size
    ds["gradient_clipping"] = optim.grad_clip
    if distributed.sequence_parallel_size > 1:
        # Read where DeepSpeed has no process-group object yet (ZeRO-3's zero.Init while the model is built): its
        # batch check divides the process count by it.
        ds["sequence_parallel_size"] = distributed.sequence_parallel_size
    if distributed.tensor_parallel_size > 1:
        ds["tensor_parallel"] = {"autotp_size": distributed.tensor_parallel_size}
    _fill_expert_parallel(ds, distributed, path)
    _fit_optimizer(ds, optim.name, path)
    # fp8: bf16 master path (DeepSpeed's bf16 optimizer), float8 only inside the converted linear layers.
    ds.setdefault("bf16", {})["enabled"] = precision in ("bf16", "fp8")
    ds.setdefault("fp16", {})["enabled"] = precision == "fp16"
    if precision not in ("bf16", "fp8"):
        # fp32 grads need no separate accumulation dtype; fp16 uses DeepSpeed's loss-scaled path.
        ds.get("data_types", {}).pop("grad_accum_dtype", None)
    ds.setdefault("steps_per_print", 2**31 - 1)  # the recipe logs; DeepSpeed's own prints are noise
    # Under offload optim.build_optimizer already returns DeepSpeedCPUAdam(adamw_mode=True). Left True, this flag
    # makes Accelerate swap it for a DeepSpeedCPUAdam(adamw_mode=False): L2 instead of decoupled weight decay.
    ds["zero_force_ds_cpu_optimizer"] = False
    return ds


def _fill_expert_parallel(ds: dict, distributed: DistributedConfig, path: str | Path) -> None:
    """DeepSpeed AutoEP's ``expert_parallel`` section from the recipe (``distributed.expert_layer`` autoep, or auto
    with ``expert_parallel_size`` > 1): on, at ``expert_parallel_size``, with the JSON's own systems keys
    (:data:`AUTOEP_SYSTEMS_KEYS`) kept. Exit 2 on any other key in the JSON's section, or on a section in a run
    whose MoE layers are not AutoEP's."""
    section = ds.get("expert_parallel")
    if section is not None:
        foreign = sorted(set(section) - set(AUTOEP_SYSTEMS_KEYS)) if isinstance(section, dict) else ["(not an object)"]
        if foreign:
            raise fail(f"""
                {path} sets {', '.join(foreign)} in its 'expert_parallel' section. The JSON keeps only how AutoEP
                runs ({', '.join(AUTOEP_SYSTEMS_KEYS)}); whether it is on and its size come from the recipe: remove
                them and set distributed.expert_parallel_size=N (and distributed.expert_layer=autoep for N=1)
                instead. AutoEP's load_balance_coeff is not supported: the router's auxiliary loss is
                model.router_aux_loss_coef.""")
    if not distributed.uses_autoep():
        if section is not None:
            raise fail(f"""
                {path} has an 'expert_parallel' section, but this run's MoE layers are not DeepSpeed AutoEP's: set
                distributed.expert_layer=autoep (or distributed.expert_parallel_size > 1), or remove the section.""")
        return
    ds["expert_parallel"] = {**(section or {}), "enabled": True, "autoep_size": distributed.expert_parallel_size}


def _refuse_parallelism_sections(ds: dict, path: str | Path) -> None:
    """Exit 2 when the JSON sets a parallel split itself (:data:`RECIPE_PARALLELISM`): DeepSpeed would split the model
    while the recipe feeds, counts and checkpoints the ranks as its own keys say (DeepSpeed's assertions, or a run
    that disagrees with its config)."""
    for key, setting in RECIPE_PARALLELISM.items():
        if key not in ds:
            continue
        size = ds[key].get("autotp_size") if isinstance(ds[key], dict) else ds[key]
        size = size if isinstance(size, int) and size > 0 else "N"
        raise fail(f"""
            {path} sets {key!r} ({json.dumps(ds[key])}). The parallel splits come from the recipe, which writes this
            value into the DeepSpeed config itself: remove {key!r} from the JSON and set {setting}={size} in the
            recipe or on the command line instead.""")


def _fit_optimizer(ds: dict, optimizer: str, path: str | Path) -> None:
    """What ``optim.name=muon`` needs of the ZeRO settings in the file: ZeRO-3 reduces Muon's gradients whole, so its
    reduce-scatter is turned off (DeepSpeed refuses the two together); optimizer offload is refused. (Clipping under
    DeepSpeed is refused by the recipe's rules: ``lmrecipe/config/rules.py``.)"""
    if optimizer != "muon":
        return
    zero = ds.setdefault("zero_optimization", {})
    if zero.get("offload_optimizer", {}).get("device", "none") not in (None, "none"):
        raise fail(f"""
            optim.name=muon cannot run with the optimizer offloaded to the CPU ({path} sets
            zero_optimization.offload_optimizer): this recipe's Muon updates run where the gradients are. Choose a
            config without offload (zero1, zero2 or zero3), or optim.name=adamw.""")
    if int(zero.get("stage", 0)) == 3 and zero.get("reduce_scatter", True):
        zero["reduce_scatter"] = False


def check_tensor_parallel_stage(tp: int, zero: ZeroSetup, path: Path) -> None:
    """AutoTP trains under ZeRO stages 0-2: the stage is read from the DeepSpeed JSON, so it is checked here."""
    if tp > 1 and zero.stage == 3:
        raise fail(f"""
            distributed.tensor_parallel_size={tp} cannot run under ZeRO-3 ({path}): DeepSpeed AutoTP training
            supports ZeRO stages 0-2. Choose distributed.deepspeed_config=zero1 or zero2 (TP already splits the
            weights that ZeRO-3 would partition), or set distributed.tensor_parallel_size=1.""")


def check_compile_stage(compile_mode: str, zero: ZeroSetup, path: Path) -> None:
    """``train.compile=layers`` under ZeRO-3 would gain nothing: ZeRO-3 gathers each linear layer's weights in a
    hook the compiler may not trace (``torch.compiler.disable``), so every decoder layer breaks into a graph per
    linear layer (measured with DeepSpeed 0.19.8 and torch 2.13 on 2 layers: 136 frames compiled by the first
    validation, where the linear layers' forward passed dynamo's recompile limit and ran eager). The stage is read
    from the DeepSpeed JSON, so it is checked here."""
    if compile_mode == "layers" and zero.stage == 3:
        raise fail(f"""
            train.compile=layers cannot run under ZeRO-3 ({path}): ZeRO-3 gathers every linear layer's weights in a
            hook that torch.compile cannot trace, so each decoder layer would break into a graph per linear layer.
            Choose train.compile=model (DeepSpeed compiles the whole engine, its hooks outside the graph), or
            distributed.deepspeed_config=zero2 (or zero1) with train.compile=layers.""")


def check_sequence_parallel_stage(sp: int, ds_config: dict, precision: str, path: Path, requested: str) -> None:
    """Ulysses under DeepSpeed's bf16 optimizer fails at the first step: that optimizer (ZeRO-1 with bf16 weights,
    fp32 gradient accumulation and no optimizer offload) takes the sequence-parallel ranks for tensor-parallel ones,
    so every rank but the first of a group finds no gradient of its own to measure ("stack expects a non-empty
    TensorList", DeepSpeed 0.19.8). Which optimizer DeepSpeed picks is read from the JSON, so it is checked here;
    ``precision`` is the resolved one (fp8 trains on that bf16 path too), ``requested`` is ``train.precision``."""
    if sp == 1 or not _uses_bf16_optimizer(ds_config):
        return
    said = f"train.precision={requested}" + (f" ({precision} here)" if requested != precision else "")
    raise fail(f"""
        distributed.sequence_parallel_size={sp} with {said} cannot run under ZeRO-1 ({path}): DeepSpeed's bf16
        ZeRO-1 optimizer counts the ranks that share a sequence as tensor-parallel ranks and fails at the first step.
        Choose distributed.deepspeed_config=zero2 or zero3 (the same training, equal to one process), or
        train.precision=fp32, or set distributed.sequence_parallel_size=1.""")


def _uses_bf16_optimizer(ds_config: dict) -> bool:
    """Whether DeepSpeed 0.19.8 trains ``ds_config`` with its ``BF16_Optimizer`` (``engine._do_optimizer_sanity_check``):
    bf16 on, ZeRO stage 1, gradients accumulated in fp32, the optimizer not offloaded to the CPU."""
    zero = ds_config.get("zero_optimization", {})
    accum = str(ds_config.get("data_types", {}).get("grad_accum_dtype", "")).lower()
    offloaded = zero.get("offload_optimizer", {}).get("device", "none") == "cpu"
    return (ds_config.get("bf16", {}).get("enabled") is True and int(zero.get("stage", 0)) == 1
            and accum in ("fp32", "float32", "float", "torch.float32") and not offloaded)


#: DeepSpeed ops that DeepSpeed compiles on a run's first use of them (a minute or more of CPU each, then cached under
#: ``$TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``): CPU Adam, ZeRO-Offload's optimizer; and the
#: shared-memory collectives that DeepSpeed's communication layer builds on a machine without a GPU.
DEEPSPEED_OPS = ("CPUAdamBuilder", "ShareMemCommBuilder")


def extensions_dir() -> Path:
    """Where torch caches the ops it compiles: ``$TORCH_EXTENSIONS_DIR``, else ``~/.cache/torch_extensions/pyXY_cpu``
    (``_cuXYZ`` with CUDA), as ``torch.utils.cpp_extension`` chooses."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"])
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    device = f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu"
    return Path(get_default_build_root()) / f"py{sys.version_info.major}{sys.version_info.minor}_{device}"


def ops_to_compile(offload_optimizer: bool) -> list[str]:
    """The ops of ``DEEPSPEED_OPS`` that a run compiles before its first step here (CPU Adam only when the optimizer
    is offloaded): those this machine's DeepSpeed uses that came neither installed nor compiled in
    :func:`extensions_dir`."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator
    from deepspeed.git_version_info import installed_ops

    names = []
    for name in DEEPSPEED_OPS:
        builder = get_accelerator().create_op_builder(name) if offload_optimizer or name != "CPUAdamBuilder" else None
        if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
            continue
        if not installed_ops.get(builder.name) and not (extensions_dir() / builder.name / f"{builder.name}.so").is_file():
            names.append(builder.name)
    return names


def log_op_compilation(offload_optimizer: bool) -> None:
    """Say what the run waits for when DeepSpeed is about to compile its ops (a minute or more, with no output)."""
    names = ops_to_compile(offload_optimizer)
    if names:
        logger.info("DeepSpeed compiles %s on first use on this machine: about a minute each, with no output, then "
                    "cached in %s. python tools/build_ops.py compiles them ahead.", " and ".join(names), extensions_dir())


def build_deepspeed_ops() -> list[str]:
    """Compile, ahead of any run, the ops of ``DEEPSPEED_OPS`` that this machine's DeepSpeed accelerator uses (or
    find them compiled); returns their names."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    built = []
    for name in DEEPSPEED_OPS:
        builder = get_accelerator().create_op_builder(name)
        if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
            continue  # not an op of this accelerator (the shared-memory collectives on a GPU)
        builder.load(verbose=False)
        built.append(builder.NAME)
    return built
