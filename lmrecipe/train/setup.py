"""Setting a run up: the Accelerator first (so ZeRO-3 partitions at construction), then data, model, optimizer.

``build_run`` returns a :class:`Run`, which ``train_step`` (``lmrecipe/train/step.py``) advances by one optimizer
step; the trainer (``lmrecipe/train/trainer.py``) owns the loop over it.
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from lmrecipe.model.attention import DocumentAttention
from lmrecipe.config import Config
from lmrecipe.data.batches import BatchRamp, MixtureBatches, Prefetcher, TrainBatches
from lmrecipe.data.sources import TrainingData, open_training_data
from lmrecipe.determinism import maybe_set_deterministic
from lmrecipe.model.loss import use_chunked_loss
from lmrecipe.model.routing import RouterLoads, build_router_loads
from lmrecipe.model.build import (
    attention_width,
    build_model,
    compile_layers,
    flops_per_token,
    fp8_layer_filter,
    param_counts,
    set_moe_leaf_modules,
)
from lmrecipe.observe.stragglers import ComputeClock
from lmrecipe.observe.trackers import check_trackers
from lmrecipe.optim import build_optimizer, lr_at
from lmrecipe.parallel.accelerator import Runtime, build_runtime
from lmrecipe.parallel.precision import maybe_allow_tf32
from lmrecipe.parallel.splits import autoep_registry_compat, name_sequence_parallel_attention
from lmrecipe.train.preflight import preflight

logger = logging.getLogger(__name__)

@dataclass
class Run:
    """A set-up training run: what ``train_step`` needs, built once by :func:`build_run`."""

    cfg: Config
    runtime: Runtime
    model: torch.nn.Module
    """The prepared model (DDP wrapper or DeepSpeed engine)."""
    optimizer: torch.optim.Optimizer
    data: TrainingData
    """The training data: the sample order and every source's validation windows."""
    prefetcher: Prefetcher
    n_params: int
    flops_per_token: float
    attention: DocumentAttention | None = None
    """The document-masking attention (``data.document_masking``): every forward takes its ``forward_kwargs``."""
    accumulating_samples: int | None = None
    """The step size (samples over all ranks) the Accelerator and a DeepSpeed engine now accumulate to; None: the
    ``train.global_batch_size`` they were built with."""
    n_active_params: int | None = None
    """Parameters one token passes through (an MoE model's routed experts counted ``experts_per_token`` times out of
    ``num_experts``); None: a dense model, all of ``n_params``."""
    compute_clock: ComputeClock | None = None
    """Times each micro-batch's forward (``lmrecipe/observe/stragglers.py``); None: not timed."""
    router_loads: RouterLoads | None = None
    """Counts the experts an MoE model's routers chose in each training forward (``lmrecipe/model/routing.py``);
    None: a dense model."""

    @property
    def train_batches(self) -> TrainBatches | MixtureBatches:
        return self.data.train_batches

    @property
    def accelerator(self):
        return self.runtime.accelerator

    @property
    def tokens_per_step(self) -> int:
        """Tokens of a step at ``train.global_batch_size`` (the size after any batch-size ramp)."""
        return self.cfg.train.global_batch_size * self.cfg.data.seq_len

    def step_tokens(self, step: int) -> int:
        """Tokens optimizer step ``step`` (1-based, as the log counts) trained on, over all ranks (a ramp's size)."""
        return self.train_batches.step_size(step - 1) * self.cfg.data.seq_len

    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step ``step`` (0-based): the schedule's, times sqrt(step size /
        ``train.global_batch_size``) during a batch-size ramp with ``train.batch_ramp_lr_scaling=sqrt``."""
        lr = lr_at(step, self.cfg.train.max_steps, self.cfg.optim, self.cfg.schedule)
        if self.cfg.train.batch_ramp_lr_scaling == "sqrt":
            lr *= math.sqrt(self.train_batches.step_size(step) / self.cfg.train.global_batch_size)
        return lr

    def accumulate_to(self, samples: int) -> None:
        """Make the next optimizer step take ``samples`` sequences (over all ranks): the micro-batch stays, the
        accumulation count changes. Call between optimizer steps only.

        Accelerate ends an accumulation by its own counter (``accelerator.step``) and DeepSpeed by its engine's count:
        both change together, and the counter restarts, or the updates are silently wrong (measured: the engine's
        ``set_train_batch_size`` alone drifts the weights by 1e-1 at a change from 2 to 4 micro-steps).
        """
        if samples == (self.accumulating_samples or self.cfg.train.global_batch_size):
            return
        layout = self.runtime.batch
        accum_steps = samples // (layout.micro_batch_size * layout.world_size)
        if self.runtime.topology.zero.deepspeed:
            # DeepSpeed's batch counts every rank of its data-parallel world, as the config it was built with did.
            ranks_per_sample = self.runtime.ds_config["train_batch_size"] // layout.global_batch_size
            self.model.set_train_batch_size(samples * ranks_per_sample)
        self.accelerator.gradient_accumulation_steps = accum_steps
        self.accelerator.step = 0
        self.accumulating_samples = samples


def build_run(cfg: Config, out_dir: Path) -> Run:
    """The start-up checks (``lmrecipe/train/preflight.py``: every problem at once, before anything is built or
    written), then the Accelerator (so ZeRO-3 partitions at construction), data, model, optimizer, ``prepare``."""
    pf = preflight(cfg, out_dir)
    pf.raise_problems()
    maybe_set_deterministic(cfg.train.deterministic, cfg.train.seed)  # before CUDA is first used
    maybe_allow_tf32(cfg.train.deterministic)
    runtime = build_runtime(cfg.workload(), pf.precision, pf.topology, pf.ds_config)
    accelerator, topology, zero = runtime.accelerator, runtime.topology, runtime.topology.zero
    if accelerator.is_main_process:
        for note in pf.notes:
            logger.warning("%s", note)
    check_trackers(cfg.logging.trackers, out_dir, accelerator)  # a tracker that cannot start stops it before it writes
    hf_config = pf.hf_config
    # Validation windows: split over every rank, or over the data-parallel ranks under tensor parallelism (a
    # tensor-parallel group computes one forward together).
    val_ranks = None if topology.tensor_parallel_size > 1 else (accelerator.num_processes, accelerator.process_index)
    ramp = BatchRamp.from_config(cfg.train, runtime.batch)
    data = open_training_data(cfg.data, hf_config.vocab_size, runtime.batch, cfg.train.seed, val_ranks=val_ranks,
                              ramp=ramp, opened_sources=pf.opened_sources)
    if not ramp.is_constant:
        logger.info("Batch-size ramp, sequences per step: %s (learning rate %s)",
                    ", ".join(f"{size} from step {step}" for step, size in zip(ramp.steps, ramp.sizes)),
                    "x sqrt(size / final size)" if cfg.train.batch_ramp_lr_scaling == "sqrt" else "as scheduled")
    if accelerator.is_main_process:
        out_dir.mkdir(parents=True, exist_ok=True)
    accelerator.wait_for_everyone()

    torch.manual_seed(cfg.train.seed)
    attention = pf.attention
    model = build_model(cfg.model, cfg.train, hf_config, attention, device=init_device(accelerator.device, topology))
    if chunk_tokens := cfg.train.chunk_tokens(hf_config.vocab_size):
        use_chunked_loss(model, chunk_tokens)
    if zero.stage == 3 and not topology.autoep:
        set_moe_leaf_modules(model)
    counts = param_counts(model)
    fpt = flops_per_token(counts["active"], counts["lookup"], hf_config.num_hidden_layers, hf_config.hidden_size,
                          cfg.data.seq_len, attention_width(hf_config))
    if cfg.train.compile == "model" and not zero.deepspeed:
        model = torch.compile(model)
    if cfg.train.compile == "layers":
        # In place and before prepare: DeepSpeed wraps the same modules, its hooks on the parameters' gradients run
        # outside the layers' graphs.
        logger.info("train.compile=layers: %d decoder layers compiled in place", compile_layers(model))
    optimizer = build_optimizer(model, cfg.optim, cpu_offload=zero.offload_optimizer,
                                fused=zero.deepspeed or runtime.precision != "fp16",
                                expert_group=topology.expert_group())
    name_sequence_parallel_attention(accelerator, model)
    if runtime.precision == "fp8":
        choose_fp8_layers(accelerator, model)
    with autoep_registry_compat() if topology.autoep else contextlib.nullcontext():
        model, optimizer = accelerator.prepare(model, optimizer)
    if cfg.train.compile == "model" and zero.deepspeed:
        model.compile()  # DeepSpeed compiles the module it wraps, keeping its own hooks outside the graph
    model.train()
    # After prepare: DeepSpeed AutoEP replaces the MoE blocks (and their routers) there.
    router_loads = build_router_loads(model)

    prefetcher = Prefetcher(data.train_batches, pin_memory=accelerator.device.type == "cuda")
    active = counts["active"] if counts["active"] != counts["total"] else None
    return Run(cfg, runtime, model, optimizer, data, prefetcher, counts["total"], fpt, attention,
               n_active_params=active, router_loads=router_loads)


def init_device(device: torch.device, topology) -> torch.device | None:
    """Where the model is created and initialised: the GPU when the whole model goes to it as it is (ZeRO-0/1/2, no
    tensor or expert split, which slice a whole model held elsewhere first; ZeRO-3 partitions at construction); else
    None, the CPU."""
    whole = topology.zero.stage != 3 and topology.tensor_parallel_size == 1 and not topology.autoep
    return device if device.type == "cuda" and whole else None


def choose_fp8_layers(accelerator, model: torch.nn.Module) -> None:
    """Tell Accelerate which linear layers ``prepare`` swaps for float8 ones, and log those that stay in bf16."""
    converts, kept = fp8_layer_filter(model)
    accelerator.ao_recipe_handler.module_filter_func = converts
    n_linear = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    logger.info("fp8: %d of %d linear layers train with float8 matmuls; in bf16: %s", n_linear - len(kept), n_linear,
                ", ".join(f"{name} ({why})" for name, why in kept.items()) or "none")
    if len(kept) == n_linear:
        logger.warning("fp8: no linear layer qualifies (all are first/last or have a dimension not divisible by 16); "
                       "the run trains in bf16.")
