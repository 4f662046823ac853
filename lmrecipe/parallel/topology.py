"""The run's topology: every parallel size and the ZeRO setup in one frozen object (:class:`Topology`), the checks a
launch's process count must pass, and what is derived from them in words."""

from __future__ import annotations

import os
from dataclasses import dataclass

from lmrecipe.config import DistributedConfig, TrainConfig
from lmrecipe.data.batches import BatchLayout
from lmrecipe.errors import fail


def world_size_from_env() -> int:
    """World size announced by the launcher (accelerate launch, torchrun, srun), before any process group exists;
    UserError naming the variable when it is not a whole number of at least 1."""
    value = os.environ.get("WORLD_SIZE", "1")
    try:
        world_size = int(value)
    except ValueError:
        world_size = 0
    if world_size < 1:
        raise fail(f"WORLD_SIZE={value!r} is not a number of processes (a whole number, at least 1). Unset it for "
                   "one process (python train.py ...), or let the launcher set it (accelerate launch, torchrun, "
                   "srun).")
    return world_size


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
class Topology:
    """How the run's processes share its work: the one record of every parallel size, decided once at start-up
    (:func:`lmrecipe.parallel.launch.check_launch`) from the recipe's ``distributed`` section, the DeepSpeed JSON and
    the launch. The Accelerator and DeepSpeed's config, the batch split (:meth:`batch_layout`), the start-up line
    (:func:`startup_line`) and each checkpoint's ``topology`` record (:meth:`record`) are derived from it; a resume on
    another topology goes through the topology-free form (``checkpoint/portable.py``).

    Consecutive ranks form the groups (DeepSpeed's grouping): ``sequence_parallel_size`` ranks share each sequence
    (Ulysses), or ``tensor_parallel_size`` ranks split each layer's matrices (AutoTP); both read the same samples, so
    the data-parallel ranks are ``world_size / (sequence_parallel_size x tensor_parallel_size)``.
    ``expert_parallel_size`` consecutive ranks split each MoE layer's experts (AutoEP) and read their own samples.
    """

    world_size: int
    zero: ZeroSetup = ZeroSetup()
    sequence_parallel_size: int = 1
    tensor_parallel_size: int = 1
    expert_parallel_size: int = 1
    """DeepSpeed AutoEP's size: each rank holds and ZeRO partitions only its share of the experts (1 without)."""
    autoep: bool = False
    """The MoE layers are DeepSpeed AutoEP's (``distributed.expert_layer``), at any ``expert_parallel_size``."""

    @classmethod
    def of_launch(cls, distributed: DistributedConfig, world_size: int, zero: ZeroSetup) -> "Topology":
        """The topology of a launch of ``world_size`` processes with the recipe's ``distributed`` section."""
        autoep = distributed.uses_autoep()
        return cls(world_size, zero, distributed.sequence_parallel_size, distributed.tensor_parallel_size,
                   distributed.expert_parallel_size if autoep else 1, autoep)

    @property
    def data_parallel_size(self) -> int:
        """Ranks that read different samples (a sequence- or tensor-parallel group reads the same ones)."""
        return self.world_size // (self.sequence_parallel_size * self.tensor_parallel_size)

    def data_parallel_rank(self, rank: int) -> int:
        """The data-parallel rank of process ``rank``: its group's index."""
        return rank // (self.sequence_parallel_size * self.tensor_parallel_size)

    def batch_layout(self, train: TrainConfig, rank: int = 0) -> BatchLayout:
        """How one optimizer step's sequences are split over the data-parallel ranks (the accumulation steps)."""
        return BatchLayout.from_config(train, self.data_parallel_size, self.data_parallel_rank(rank))

    def expert_group(self) -> str | None:
        """The optimizer's name for the expert parameters' groups under AutoEP (:func:`autoep_group_name`)."""
        return autoep_group_name(self.expert_parallel_size) if self.autoep else None

    def describe_ranks(self) -> str:
        """The processes and their groups in words, for the start-up line."""
        dp = self.data_parallel_size
        if self.sequence_parallel_size > 1:
            return f"{dp} data-parallel groups of {self.sequence_parallel_size} ranks sharing each sequence"
        if self.tensor_parallel_size > 1:
            return f"{dp} data-parallel groups of {self.tensor_parallel_size} ranks splitting each matrix (AutoTP)"
        if self.autoep:
            return f"{dp} processes ({describe_expert_groups(self.expert_parallel_size, dp)})"
        return f"{dp} processes"

    # ---- the checkpoint's record

    def record(self) -> dict:
        """What each checkpoint records as its ``topology``: how its optimizer state is cut."""
        zero = self.zero
        return {"world_size": self.world_size, "deepspeed": zero.deepspeed,
                "zero_stage": zero.stage if zero.deepspeed else 0, "offload_optimizer": zero.offload_optimizer,
                "offload_param": zero.offload_param, "sequence_parallel_size": self.sequence_parallel_size,
                "tensor_parallel_size": self.tensor_parallel_size, "expert_parallel_size": self.expert_parallel_size}

    @classmethod
    def from_record(cls, record: dict) -> "Topology":
        """The topology a checkpoint's ``topology`` record describes (older records lack the offload and sequence,
        tensor or expert parallel keys)."""
        deepspeed = bool(record["deepspeed"])
        zero = ZeroSetup(int(record["zero_stage"]) if deepspeed else 0, bool(record.get("offload_optimizer", False)),
                         bool(record.get("offload_param", False)), deepspeed=deepspeed)
        expert_parallel_size = int(record.get("expert_parallel_size", 1))
        return cls(int(record["world_size"]), zero, int(record.get("sequence_parallel_size", 1)),
                   int(record.get("tensor_parallel_size", 1)), expert_parallel_size, autoep=expert_parallel_size > 1)

    def describe_state(self) -> str:
        """How the optimizer state is held, in words: ``no DeepSpeed`` or the ZeRO stage and its offload."""
        zero = self.zero
        if not zero.deepspeed:
            return "no DeepSpeed"
        offload = [name for name, on in (("optimizer", zero.offload_optimizer), ("param", zero.offload_param)) if on]
        return f"ZeRO-{zero.stage}" + (f" (offload {', '.join(offload)})" if offload else "")

    def changes_from(self, saved: "Topology") -> list[str]:
        """What differs from the saving topology ``saved``, in words (empty: the same)."""
        changes = []
        if saved.world_size != self.world_size:
            changes.append(f"processes {saved.world_size} -> {self.world_size}")
        if saved.describe_state() != self.describe_state():
            changes.append(f"{saved.describe_state()} -> {self.describe_state()}")
        for what, before, now in (("sequence", saved.sequence_parallel_size, self.sequence_parallel_size),
                                  ("tensor", saved.tensor_parallel_size, self.tensor_parallel_size),
                                  ("expert", saved.expert_parallel_size, self.expert_parallel_size)):
            if before != now:
                changes.append(f"{what} parallel {before} -> {now}")
        return changes

    def needs_conversion_from(self, saved: "Topology") -> bool:
        """Whether state saved on ``saved`` cannot be loaded as it is. Without DeepSpeed on both sides the state is
        whole on every rank, so any process count loads it; DeepSpeed loads its own shards only into the same
        stage, offload and data-parallel size."""
        return (saved.zero.deepspeed or self.zero.deepspeed) and self.changes_from(saved) != []


def startup_line(n_params: int, n_active: int | None, topology: Topology, batch: BatchLayout, seq_len: int,
                 precision: str, chunk_tokens: int) -> str:
    """The line a run logs at its start, and ``train.py --dry-run`` prints (``n_active``: an MoE model's parameters
    per token; ``chunk_tokens``: the loss's chunk, 0 for full logits)."""
    params = f"{n_params / 1e6:.2f}M params" + (f" ({n_active / 1e6:.2f}M active per token)" if n_active else "")
    return (f"model {params} | {topology.describe_ranks()} x micro-batch {batch.micro_batch_size} x accumulation "
            f"{batch.accum_steps} = {batch.global_batch_size} sequences of {seq_len} tokens | precision {precision} | "
            f"{topology.zero.describe()}" + (f" | loss in chunks of {chunk_tokens} tokens" if chunk_tokens else ""))


def autoep_group_name(expert_parallel_size: int) -> str:
    """DeepSpeed AutoEP's name of the expert-parallel process group (and of its optimizer groups)."""
    return f"ep_size_{expert_parallel_size}"


def describe_expert_groups(ep: int, world_size: int) -> str:
    """DeepSpeed AutoEP's expert-parallel groups of ``world_size`` ranks in words: ``ep`` consecutive ranks each."""
    groups = ", ".join(f"[{g * ep}-{g * ep + ep - 1}]" if ep > 1 else f"[{g}]" for g in range(world_size // ep))
    return f"AutoEP expert parallel {ep}: expert groups {groups}"


def _check_divides(key: str, size: int, world_size: int, what: str) -> None:
    """Exit 2 when ``distributed.<key>`` does not divide the launch's processes, checked before any process group
    exists (what the split needs of the recipe: ``lmrecipe/config/rules.py``)."""
    if world_size % size:
        raise fail(f"distributed.{key}={size} does not divide the world size {world_size} (the processes launched): "
                   f"each group of {size} consecutive ranks {what}. Launch a multiple of {size} processes, or choose a "
                   f"divisor of {world_size}.")


def check_sequence_parallel_topology(sp: int, world_size: int) -> None:
    _check_divides("sequence_parallel_size", sp, world_size, "shares a sequence")


def check_tensor_parallel_topology(tp: int, world_size: int) -> None:
    _check_divides("tensor_parallel_size", tp, world_size, "splits the model's matrices")


def check_expert_parallel_topology(ep: int, world_size: int) -> None:
    _check_divides("expert_parallel_size", ep, world_size, "splits every MoE layer's experts")
