"""Building the Accelerator and its DeepSpeed plugin, with every "auto" value filled from the recipe.

:func:`build_runtime` derives the run's topology once: the precision, the batch layout (accumulation steps),
the filled DeepSpeed config and its :class:`ZeroSetup`; every other component receives them from it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import socket
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path

import torch

from lmrecipe.config import Config, DistributedConfig, OptimConfig, Workload
from lmrecipe.data.batches import BatchLayout
from lmrecipe.errors import fail
from lmrecipe.observe.quiet import quiet_prints

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


def autoep_group_name(expert_parallel_size: int) -> str:
    """DeepSpeed AutoEP's name of the expert-parallel process group (and of its optimizer groups)."""
    return f"ep_size_{expert_parallel_size}"


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
    sequence_parallel_size: int = 1
    tensor_parallel_size: int = 1
    expert_parallel_size: int = 1
    """DeepSpeed AutoEP's size: each rank holds and ZeRO partitions only its share of the experts (1 without)."""

    @classmethod
    def of_run(cls, world_size: int, zero: ZeroSetup, sequence_parallel_size: int = 1,
               tensor_parallel_size: int = 1, expert_parallel_size: int = 1) -> "Layout":
        return cls(world_size, zero.deepspeed, zero.stage if zero.deepspeed else 0, zero.offload_optimizer,
                   zero.offload_param, sequence_parallel_size, tensor_parallel_size, expert_parallel_size)

    @classmethod
    def from_topology(cls, topology: dict) -> "Layout":
        """The layout a checkpoint's ``topology`` record describes (older records lack the offload and sequence,
        tensor or expert parallel keys)."""
        deepspeed = bool(topology["deepspeed"])
        return cls(int(topology["world_size"]), deepspeed, int(topology["zero_stage"]) if deepspeed else 0,
                   bool(topology.get("offload_optimizer", False)), bool(topology.get("offload_param", False)),
                   int(topology.get("sequence_parallel_size", 1)), int(topology.get("tensor_parallel_size", 1)),
                   int(topology.get("expert_parallel_size", 1)))

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
        if saved.sequence_parallel_size != self.sequence_parallel_size:
            changes.append(f"sequence parallel {saved.sequence_parallel_size} -> {self.sequence_parallel_size}")
        if saved.tensor_parallel_size != self.tensor_parallel_size:
            changes.append(f"tensor parallel {saved.tensor_parallel_size} -> {self.tensor_parallel_size}")
        if saved.expert_parallel_size != self.expert_parallel_size:
            changes.append(f"expert parallel {saved.expert_parallel_size} -> {self.expert_parallel_size}")
        return changes

    def needs_conversion_from(self, saved: "Layout") -> bool:
        """Whether state saved on ``saved`` cannot be loaded as it is. Without DeepSpeed on both sides the state is
        whole on every rank, so any process count loads it; DeepSpeed loads its own shards only into the same
        stage, offload and data-parallel size."""
        return (saved.deepspeed or self.deepspeed) and self.changes_from(saved) != []


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


def check_fp8() -> None:
    """What ``train.precision=fp8`` needs: torchao, and a GPU with float8 tensor cores (compute capability 8.9 or
    later: Ada, Hopper, Blackwell). Without a GPU, torchao emulates the float8 matmuls (for tests)."""
    try:
        import torchao.float8  # noqa: F401
    except ImportError as err:
        raise fail(f"train.precision=fp8 needs torchao ({err}): pip install torchao==0.18.0, or choose "
                   "train.precision=bf16.") from None
    if torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9):
        name = torch.cuda.get_device_name()
        raise fail(f"train.precision=fp8 needs float8 tensor cores (compute capability 8.9+: H100, H200, L40S, RTX "
                   f"4090); the {name} has {torch.cuda.get_device_capability()}. Use train.precision=bf16.")


def fp8_recipe():
    """Accelerate's torchao recipe. The float8 all-gather is off: ZeRO-2/3 fail to swap the weight for its float8
    subclass with it on ("Couldn't swap Float8Linear.weight"), and DeepSpeed gathers bf16 weights anyway. Which
    layers convert is set per model before ``prepare`` (``model.fp8_layer_filter``)."""
    from accelerate.utils import AORecipeKwargs
    from torchao.float8 import Float8LinearConfig

    return AORecipeKwargs(config=Float8LinearConfig(enable_fsdp_float8_all_gather=False))


def _launch_arguments(argv: list[str]) -> list[str] | None:
    """The arguments after ``accelerate launch`` (or ``python -m accelerate.commands.launch``) in a command line;
    None when it is not that command."""
    for i, arg in enumerate(argv):
        if arg == "launch" and i > 0 and Path(argv[i - 1]).name in ("accelerate", "accelerate_cli.py"):
            return argv[i + 1:]
        if arg in ("accelerate.commands.launch", "accelerate.commands.accelerate_cli") and i > 0 and argv[i - 1] == "-m":
            rest = argv[i + 1:]
            return rest[1:] if arg.endswith("accelerate_cli") and rest[:1] == ["launch"] else rest
    return None


def shrunk_launch(environ: dict, parent_argv: list[str] | None) -> int | None:
    """The process count that ``accelerate launch`` was asked for (``--num_processes N``, N > 1) when it started this
    process alone: without ``--multi_gpu`` (or ``--use_deepspeed``, ``--use_fsdp``), or with ``--cpu``, its simple
    launcher runs the script once, sets no ``WORLD_SIZE`` and says nothing. None otherwise.

    ``environ``: this process's environment; ``parent_argv``: the parent process's command line (the launcher's).
    """
    if "WORLD_SIZE" in environ or "ACCELERATE_DYNAMO_BACKEND" not in environ or not parent_argv:
        return None  # a distributed launcher's process, or not one of accelerate's launcher
    launch_args = _launch_arguments(parent_argv)
    if launch_args is None:
        return None
    import io

    from accelerate.commands.launch import launch_command_parser
    from accelerate.commands.utils import CustomArgumentParser

    # The parser of the accelerate command line itself: hyphens or underscores, no abbreviations.
    commands = CustomArgumentParser(add_help=False, allow_abbrev=False)
    launch_command_parser(commands.add_subparsers())
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            args = commands.parse_args(["launch", *launch_args])
    except SystemExit:
        return None
    processes = args.num_processes
    distributed = args.multi_gpu or args.use_deepspeed or args.use_fsdp or args.use_megatron_lm or args.tpu
    if processes is None or processes < 2 or (distributed and not args.cpu):
        return None
    return processes


def _parent_command_line() -> list[str] | None:
    try:
        raw = Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
    except OSError:
        return None  # no /proc (not Linux): the check is skipped
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def check_launched_processes() -> None:
    """Exit 2 when ``accelerate launch --num_processes N`` started this process alone (:func:`shrunk_launch`): the run
    would train on one process instead of N, silently."""
    requested = shrunk_launch(dict(os.environ), _parent_command_line())
    if requested is None:
        return
    raise fail(f"accelerate launch was asked for {requested} processes (--num_processes {requested}) but started this "
               "script once: without --multi_gpu (or --use_deepspeed), or with --cpu, its launcher runs a single "
               f"process, and this run would train on 1 process instead of {requested}. Relaunch with accelerate "
               f"launch --multi_gpu --num_processes {requested} train.py RECIPE [key=value ...] (python "
               "tools/launch_flags.py RECIPE [key=value ...] prints the flags a recipe needs), or leave out "
               "--num_processes to train on one process.")


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
    sequence: SequenceParallel | None = None
    """This rank's share of each sequence (``distributed.sequence_parallel_size`` > 1); None: whole sequences."""
    tensor_parallel_size: int = 1
    """Consecutive ranks that split each layer's matrices (DeepSpeed AutoTP) and read the same samples."""
    expert_parallel_size: int = 1
    """Consecutive ranks that split each MoE layer's experts (DeepSpeed AutoEP); each reads its own samples."""
    autoep: bool = False
    """The MoE layers are DeepSpeed AutoEP's (``distributed.expert_layer``), at any ``expert_parallel_size``."""

    def expert_group(self) -> str | None:
        """The optimizer's name for the expert parameters' groups under AutoEP (:func:`autoep_group_name`)."""
        return autoep_group_name(self.expert_parallel_size) if self.autoep else None

    def describe_experts(self) -> str:
        """The expert-parallel groups, for the start-up line ('' without AutoEP)."""
        return describe_expert_groups(self.expert_parallel_size, self.layout.world_size) if self.autoep else ""


def describe_expert_groups(ep: int, world_size: int) -> str:
    """DeepSpeed AutoEP's expert-parallel groups of ``world_size`` ranks in words: ``ep`` consecutive ranks each."""
    groups = ", ".join(f"[{g * ep}-{g * ep + ep - 1}]" if ep > 1 else f"[{g}]" for g in range(world_size // ep))
    return f"AutoEP expert parallel {ep}: expert groups {groups}"


def build_runtime(cfg: Config) -> Runtime:
    """The Accelerator (and DeepSpeed plugin). Build it before the model so ZeRO-3 partitions at construction."""
    from accelerate.utils import DeepSpeedPlugin

    precision = resolve_precision(cfg.train.precision)
    if precision == "fp16" and not torch.cuda.is_available():
        raise fail("train.precision=fp16 needs a GPU; use fp32 or bf16 on a CPU.")
    if precision == "fp8":
        check_fp8()
    check_launched_processes()
    world_size = world_size_from_env()
    sp, tp = cfg.distributed.sequence_parallel_size, cfg.distributed.tensor_parallel_size
    shared = sp * tp
    layout, ds_config = check_launch(cfg.workload(), cfg.distributed.deepspeed_config_path(), world_size, precision)
    plugin = None
    if ds_config is not None:
        _ensure_single_process_env()
        plugin = DeepSpeedPlugin(hf_ds_config=ds_config)
    parallelism = _sequence_parallelism(sp, world_size, cfg.data.seq_len) if sp > 1 else None
    with quiet_prints():  # DeepSpeed prints a line per process as it sets up its CPU collectives
        accelerator = _build_accelerator(world_size, precision, layout.accum_steps, plugin, cfg.distributed.timeout_s,
                                         parallelism)
    rank = accelerator.process_index
    sequence = SequenceParallel.of_rank(sp, rank, ds_config) if sp > 1 else None
    return Runtime(accelerator, precision, replace(layout, rank=rank // shared), ZeroSetup.from_ds_config(ds_config),
                   ds_config, sequence, tp, cfg.distributed.expert_parallel_size, cfg.distributed.uses_autoep())


def check_launch(work: Workload, ds_path: str | Path | None, world_size: int,
                 precision: str) -> tuple[BatchLayout, dict | None]:
    """What a launch of ``world_size`` processes needs of the recipe's ``work`` and its DeepSpeed JSON, checked before
    any process group exists (training, and the tools that plan runs, judge it alike): the parallel splits divide the
    processes, the global batch splits over the data-parallel ranks, the JSON is valid for the recipe and its ZeRO
    stage suits the splits. Returns the batch layout and the filled DeepSpeed config (None without DeepSpeed)."""
    sp, tp = work.distributed.sequence_parallel_size, work.distributed.tensor_parallel_size
    check_sequence_parallel_topology(sp, world_size)
    check_tensor_parallel_topology(tp, world_size)
    check_expert_parallel_topology(work.distributed.expert_parallel_size, world_size)
    # Data-parallel ranks: the ranks of one sequence- or tensor-parallel group read the same samples.
    layout = BatchLayout.from_config(work.train, world_size // (sp * tp))
    if ds_path is None:
        return layout, None
    ds_config = load_deepspeed_config(ds_path, work.optim, work.distributed, layout, precision)
    check_tensor_parallel_stage(tp, ZeroSetup.from_ds_config(ds_config), Path(ds_path))
    check_sequence_parallel_stage(sp, ds_config, precision, Path(ds_path), work.train.precision)
    return layout, ds_config


@dataclass(frozen=True)
class SequenceParallel:
    """Ulysses sequence parallelism: ranks ``[g * size, (g + 1) * size)`` form group g (DeepSpeed's grouping) and
    share each of its sequences; group rank ``rank`` holds tokens ``[rank * L, (rank + 1) * L)``, ``L = seq_len /
    size``. Inside attention DeepSpeed's all-to-alls trade the sequence split for a head split, so every rank attends
    over the whole sequence for ``heads / size`` heads; elsewhere a rank computes only its own tokens.

    Each rank backpropagates its own tokens' mean loss divided by ``loss_divisor``, so the reduced gradient is the
    gradient of the windows' mean loss, as without sequence parallelism (every rank holds an equal number of
    tokens: ``seq_len`` divides evenly and every token has a target). DeepSpeed 0.19.8 reduces differently by path:
    ZeRO-1/2 (and ZeRO-3 with ``"reduce_scatter": false``) sum a group's gradients and average over the
    data-parallel ranks (divisor = size); ZeRO-3's default reduce-scatter averages over every rank (divisor 1).
    The multi-process tests compare gradient norms with and without sequence parallelism for each stage. The logged
    loss is the mean over ranks of their tokens' means: the same figure as without.
    """

    size: int
    rank: int
    loss_divisor: int = 1

    @classmethod
    def of_rank(cls, size: int, rank: int, ds_config: dict) -> "SequenceParallel":
        zero = ds_config.get("zero_optimization", {})
        averages_over_all = int(zero.get("stage", 0)) == 3 and zero.get("reduce_scatter", True)
        return cls(size, rank % size, 1 if averages_over_all else size)

    def shard(self, inputs: torch.Tensor, targets: torch.Tensor, model_kwargs: dict, device) -> tuple:
        """This rank's tokens of a micro-batch and the forward keywords for them: its slice of ``position_ids``
        (whole-window positions otherwise; DeepSpeed all-gathers them in every attention layer); the document
        keywords of document masking stay whole, as they describe the sequence the attention sees."""
        seq_len = inputs.shape[1]
        local = slice(self.rank * seq_len // self.size, (self.rank + 1) * seq_len // self.size)
        kwargs = dict(model_kwargs)
        positions = kwargs.get("position_ids")
        if positions is None:
            positions = torch.arange(local.start, local.stop, device=device).expand(inputs.shape[0], -1)
        else:
            positions = positions[:, local]
        kwargs["position_ids"] = positions
        return inputs[:, local], targets[:, local], kwargs


def check_sequence_parallel_topology(sp: int, world_size: int) -> None:
    """What ``distributed.sequence_parallel_size`` needs of the launch, checked before any process group exists (what
    it needs of the recipe: ``lmrecipe/config/rules.py``)."""
    if world_size % sp:
        raise fail(f"distributed.sequence_parallel_size={sp} does not divide the world size {world_size} (the processes "
                   f"launched): each group of {sp} consecutive ranks shares a sequence. Launch a multiple of {sp} "
                   f"processes, or choose a divisor of {world_size}.")


def check_tensor_parallel_topology(tp: int, world_size: int) -> None:
    """What ``distributed.tensor_parallel_size`` needs of the launch, checked before any process group exists (what
    it needs of the recipe: ``lmrecipe/config/rules.py``)."""
    if world_size % tp:
        raise fail(f"distributed.tensor_parallel_size={tp} does not divide the world size {world_size} (the processes "
                   f"launched): each group of {tp} consecutive ranks splits the model's matrices. Launch a multiple of "
                   f"{tp} processes, or choose a divisor of {world_size}.")


def check_expert_parallel_topology(ep: int, world_size: int) -> None:
    """What ``distributed.expert_parallel_size`` needs of the launch, checked before any process group exists (what it
    needs of the recipe: ``lmrecipe/config/rules.py``)."""
    if world_size % ep:
        raise fail(f"distributed.expert_parallel_size={ep} does not divide the world size {world_size} (the processes "
                   f"launched): each group of {ep} consecutive ranks splits every MoE layer's experts. Launch a multiple "
                   f"of {ep} processes, or choose a divisor of {world_size}.")


@contextlib.contextmanager
def autoep_registry_compat():
    """Where this recipe works around DeepSpeed 0.19.8 AutoEP and transformers 5.23 disagreeing, and only there.

    AutoEP re-points the models' router-logit recorders through transformers' ``_CAN_RECORD_REGISTRY``, calling
    ``registry.get(class_name, default)`` on it as on a plain dict; transformers 5.23 changed that method to
    ``get(model)`` (keyed by a model's class), so the call fails with "_CanRecordRegistry.get() takes 2 positional
    arguments" (and a class name alone would find nothing). While the engine is built, the method also takes a class
    name and a default, as a dict's does. ``tests/unit/test_moe.py`` fails once transformers or DeepSpeed no longer
    disagree, so that this can go.
    """
    from transformers.utils.output_capturing import _CanRecordRegistry

    original = _CanRecordRegistry.get

    def get(registry, key, *default):
        if isinstance(key, str):
            return dict.get(registry, key, *default)
        return original(registry, key)

    _CanRecordRegistry.get = get
    try:
        yield
    finally:
        _CanRecordRegistry.get = original


def check_tensor_parallel_stage(tp: int, zero: ZeroSetup, path: Path) -> None:
    """AutoTP trains under ZeRO stages 0-2: the stage is read from the DeepSpeed JSON, so it is checked here."""
    if tp > 1 and zero.stage == 3:
        raise fail(f"""
            distributed.tensor_parallel_size={tp} cannot run under ZeRO-3 ({path}): DeepSpeed AutoTP training
            supports ZeRO stages 0-2. Choose distributed.deepspeed_config=zero1 or zero2 (TP already splits the
            weights that ZeRO-3 would partition), or set distributed.tensor_parallel_size=1.""")


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


def check_tensor_parallel_model(tp: int, hf_config) -> None:
    """What ``distributed.tensor_parallel_size`` (``tp``) needs of the built model's config: every split matrix divides
    evenly. The rule ``tensor_parallel_divides_model`` refuses a recipe's own shape at load; this check covers a model
    continued from ``model.init_from``, whose shape is its checkpoint's."""
    if tp == 1:
        return
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    intermediate = hf_config.intermediate_size
    if heads % tp or kv_heads % tp or intermediate % tp:
        raise fail(f"""
            distributed.tensor_parallel_size={tp} must divide the attention heads (model.num_heads={heads}), the
            key/value heads ({kv_heads}) and model.intermediate_size={intermediate}: each rank holds an equal share
            of every split matrix. Choose a tensor_parallel_size that divides all three.""")


def check_sequence_parallel_model(sp: int, hf_config) -> None:
    """What ``distributed.sequence_parallel_size`` (``sp``) needs of the built model's config (exit 2 naming the fix).
    The rules ``sequence_parallel_*`` refuse a recipe's own shape, windows and attention at load; this check covers a
    model continued from ``model.init_from``, whose heads are its checkpoint's."""
    if sp == 1:
        return
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    if heads % sp or (kv_heads % sp and sp % kv_heads):
        raise fail(f"""
            distributed.sequence_parallel_size={sp} must divide the attention heads (model.num_heads={heads}) and
            divide or be a multiple of the key/value heads ({kv_heads}): the all-to-all splits heads over the group.
            Choose a sequence_parallel_size that does.""")


def _sequence_parallelism(sp: int, world_size: int, seq_len: int):
    """Accelerate's ParallelismConfig for DeepSpeed Ulysses; the attention it wraps is named before ``prepare``
    (:func:`name_sequence_parallel_attention`)."""
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig

    handler = DeepSpeedSequenceParallelConfig(sp_seq_length=seq_len, sp_seq_length_is_variable=False,
                                              sp_attn_implementation="sdpa")
    # dp_replicate_size: Accelerate sizes DeepSpeed's train_batch_size from it under SP.
    return ParallelismConfig(sp_backend="deepspeed", sp_size=sp, sp_handler=handler,
                             dp_replicate_size=world_size // sp)


def name_sequence_parallel_attention(accelerator, model) -> None:
    """Tell Accelerate which attention function Ulysses wraps: the one the model was built with. The recipe's
    attention functions are registered in transformers' ``AttentionInterface`` under their own names (no mask
    builder, no host sync), which Accelerate's up-front check of builtin names does not know; DeepSpeed accepts
    any registered name that matches the model's. With fewer key/value heads than ranks, evaluation forwards are
    kept on the model's own head count (:func:`_keep_key_value_groups`)."""
    config = getattr(accelerator, "parallelism_config", None)
    if config is not None and config.sp_size > 1:
        config.sp_handler.sp_attn_implementation = model.config._attn_implementation
        kv_heads = getattr(model.config, "num_key_value_heads", None) or model.config.num_attention_heads
        if kv_heads < config.sp_size:
            _keep_key_value_groups(model)


def _keep_key_value_groups(model) -> None:
    """With fewer key/value heads than ranks, Ulysses replicates them and overwrites each attention module's
    ``num_key_value_groups`` (query heads per key/value head) with its per-rank value during a training forward, and
    never restores it. An evaluation forward (the validation loss, the checkpoint's probe) runs the attention
    unsplit, on every head, so it would repeat the key/value heads too few times (a shape error in the first
    validation or checkpoint): each attention module gets its own count back before every forward (the Ulysses
    path sets its own again inside)."""
    for module in model.modules():
        groups = getattr(module, "num_key_value_groups", None)
        if isinstance(groups, int):
            module.register_forward_pre_hook(lambda m, args, groups=groups: setattr(m, "num_key_value_groups", groups))


def build_eval_accelerator():
    """A plain Accelerator (no DeepSpeed: evaluated weights are consolidated), fp32, on any number of processes."""
    return _build_accelerator(world_size_from_env(), "fp32", 1, None, 1800)


def _build_accelerator(world_size: int, precision: str, accum_steps: int, plugin, timeout_s: int,
                       parallelism=None):
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    # Without an accelerator, Accelerate must be told the backend or every rank believes it is rank 0.
    distributed = world_size > 1 or plugin is not None
    backend = "gloo" if distributed and not torch.cuda.is_available() else None
    handlers = [InitProcessGroupKwargs(backend=backend, timeout=timedelta(seconds=timeout_s))] if distributed else []
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


#: DeepSpeed ops that DeepSpeed compiles on a run's first use of them (a minute or more of CPU each, then cached under
#: ``$TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``): CPU Adam, ZeRO-Offload's optimizer; and the
#: shared-memory collectives that DeepSpeed's communication layer builds on a machine without a GPU.
DEEPSPEED_OPS = ("CPUAdamBuilder", "ShareMemCommBuilder")


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
