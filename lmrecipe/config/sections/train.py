"""The ``train`` and ``spike`` sections: the run's length, batch sizes (and their ramp), precision and the loop's
features; loss-spike detection and rollback.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from lmrecipe.config.sections.common import FIXED_ON_RESUME, fixed, non_negative, positive
from lmrecipe.errors import fail

Precision = Literal["auto", "bf16", "fp16", "fp32", "fp8"]


AUTO_LOSS_CHUNK_TOKENS = 1024
AUTO_LOSS_CHUNK_MIN_VOCAB = 65_536


CompileMode = Literal["none", "model", "layers"]
"""The choices of ``train.compile``."""
COMPILE_FROM_BOOL = {True: "model", False: "none"}
"""``train.compile`` written as the switch it was before it became a choice."""


class Compile(str):
    """A ``train.compile`` value (:data:`CompileMode`) whose truth is "is anything compiled": false for ``none``
    alone, so ``if cfg.train.compile:`` reads as it did when the key was a switch."""

    def __bool__(self) -> bool:
        return self != "none"


@dataclass
class BatchSize:
    """One point of a batch-size ramp (``train.batch_ramp``)."""

    step: int
    """Optimizer step (0-based) from which the size holds."""
    size: int
    """Sequences per optimizer step over all processes, from ``step`` on."""


@dataclass
class TrainConfig:
    max_steps: int = 1000
    """Optimizer steps of the whole run."""
    global_batch_size: int = fixed(32)
    """Sequences per optimizer step, over all processes and accumulation micro-steps."""
    micro_batch_size: int = 8
    """Sequences per forward pass on one process."""
    seed: int = fixed(1337)
    """Seed of the initialisation and of the data order."""
    precision: Precision = "auto"
    """auto = bf16 on GPUs that support it, fp16 on older GPUs, fp32 on CPUs; or an explicit value. fp8 = bf16 mixed
    precision with torchao's float8 matmuls in the linear layers (all but the first and last, and those with a
    dimension not divisible by 16): H100/H200/Ada GPUs; on a CPU the float8 matmuls are emulated (slow, for tests)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass to save memory."""
    checkpointing_reentrant: bool = True
    """Use reentrant activation checkpointing (the variant that works under ZeRO-3)."""
    compile: CompileMode = field(default=Compile("none"), metadata={"from_bool": COMPILE_FROM_BOOL})
    """``torch.compile`` (inductor): none = eager; model = the whole model (under DeepSpeed the engine's
    ``compile()``); layers = each decoder layer compiled in place (regional compile: the layers share one graph, so
    compiling takes about one layer's time at any depth). true and false, from when the key was a switch, read as
    model and none."""
    eval_every_steps: int = 100
    """Evaluate on the validation windows every this many optimizer steps (and at the end); 0 = end only."""
    max_consecutive_skips: int = 5
    """Stop the run after this many consecutive updates skipped for a non-finite loss or gradient norm."""
    early_stopping_patience: int = 0
    """Stop after this many evaluations in a row without improvement of the validation loss; 0 = never."""
    early_stopping_min_delta: float = 0.0
    """An evaluation improves when its loss is below the best so far by more than this (loss units)."""
    deterministic: bool = False
    """Deterministic kernels (``torch.use_deterministic_algorithms``, ``CUBLAS_WORKSPACE_CONFIG``) for debugging."""
    loss_chunk_tokens: Optional[int] = None
    """The chunked loss (``lmrecipe/model/loss.py``): logits and their gradient are computed this many tokens at a time and
    never held whole. 0 = off (full logits); null = auto: 1,024 when the vocabulary has at least 65,536 tokens
    (Llama-3, Qwen, Gemma), off below (there the logits of a micro-batch are small next to the activations and the
    recomputation would cost more than it saves)."""
    ema_decay: float = 0.0
    """Decay per applied optimizer step of an exponential moving average of the weights (bias-corrected, fp32; an
    average over about ``1 / (1 - ema_decay)`` steps, e.g. 0.999: 1,000 steps), evaluated as ``val_loss_ema`` and
    saved in checkpoints (``lmrecipe/train/callbacks/ema.py``); 0 = off. In [0, 1)."""
    z_loss: float = 0.0
    """Coefficient of the z-loss, ``z_loss * logsumexp(logits)^2`` averaged over the target tokens and added to the
    training objective (it keeps the logits' log-partition near 0; PaLM used 1e-4); logged as ``z_loss``, apart from
    ``loss``. Validation, perplexity and ``eval.py`` report the language-model loss alone. 0 = off."""

    batch_ramp: list[BatchSize] = field(default_factory=list, metadata=FIXED_ON_RESUME)
    """A batch-size ramp as points ``[{step: 0, size: 64}, {step: 500, size: 128}, {step: 1000, size: 256}]``: from
    optimizer step ``step`` on, ``size`` sequences per step. The first point is at step 0, steps increase, and the last
    size is ``global_batch_size`` (the run's size from there on). Sizes must be multiples of ``micro_batch_size`` x
    the data-parallel processes: the micro-batch stays, the accumulation count changes. Empty = no ramp (or the
    linear form ``batch_ramp_start_size``). Fixed on resume."""
    batch_ramp_start_size: int = fixed(0)
    """A linear ramp: the first step's size in sequences, raised by ``batch_ramp_increment`` every
    ``batch_ramp_steps_per_increment`` optimizer steps until it reaches ``global_batch_size``; 0 = off."""
    batch_ramp_increment: int = fixed(0)
    """Sequences added to the step size at each increment of the linear ramp."""
    batch_ramp_steps_per_increment: int = fixed(0)
    """Optimizer steps between two increments of the linear ramp."""
    batch_ramp_lr_scaling: Literal["none", "sqrt"] = "none"
    """During a batch-size ramp: none = the schedule's learning rate as it is; sqrt = scaled by
    sqrt(step size / global_batch_size) (the rate is the schedule's at the full size)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "compile":  # every writer alike (the loader, a saved config, a test's TrainConfig(compile=True))
            value = Compile(COMPILE_FROM_BOOL[value] if isinstance(value, bool) else value)
        super().__setattr__(name, value)

    def _validate_ramp(self) -> None:
        non_negative(self, "batch_ramp_start_size", "batch_ramp_increment", "batch_ramp_steps_per_increment")
        if self.batch_ramp and self.batch_ramp_start_size:
            raise fail("train.batch_ramp and train.batch_ramp_start_size are both set: describe the ramp one way, as "
                       "points (train.batch_ramp) or linearly (train.batch_ramp_start_size, _increment, "
                       "_steps_per_increment); set the other to [] or 0.")
        if self.batch_ramp_start_size and (self.batch_ramp_increment <= 0 or self.batch_ramp_steps_per_increment <= 0):
            raise fail(f"train.batch_ramp_start_size={self.batch_ramp_start_size} needs train.batch_ramp_increment and "
                       "train.batch_ramp_steps_per_increment > 0, e.g. batch_ramp_increment=8 and "
                       "batch_ramp_steps_per_increment=100.")
        if self.batch_ramp_start_size > self.global_batch_size:
            raise fail(f"train.batch_ramp_start_size={self.batch_ramp_start_size} exceeds train.global_batch_size="
                       f"{self.global_batch_size}, the size the ramp ends at: start below it.")
        points = self.batch_ramp
        if not points:
            return
        half, full = max(1, self.global_batch_size // 2), self.global_batch_size
        example = f"e.g. [{{step: 0, size: {half}}}, {{step: 100, size: {full}}}]"
        if points[0].step != 0:
            raise fail(f"train.batch_ramp[0].step={points[0].step}: the ramp must start at step 0 ({example}).")
        for i, (before, point) in enumerate(zip(points, points[1:]), start=1):
            if point.step <= before.step:
                raise fail(f"train.batch_ramp[{i}].step={point.step} is not after train.batch_ramp[{i - 1}].step="
                           f"{before.step}: list the points in increasing step order ({example}).")
        for i, point in enumerate(points):
            if not 0 < point.size <= self.global_batch_size:
                raise fail(f"train.batch_ramp[{i}].size={point.size} must be in [1, train.global_batch_size="
                           f"{self.global_batch_size}] ({example}).")
        if points[-1].size != self.global_batch_size:
            raise fail(f"train.batch_ramp ends at size {points[-1].size}, not at train.global_batch_size="
                       f"{self.global_batch_size} (the run's final size): add a last point "
                       f"{{step: N, size: {self.global_batch_size}}} ({example}).")

    def chunk_tokens(self, vocab_size: int) -> int:
        """Tokens per chunk of the chunked loss for a vocabulary of ``vocab_size``; 0 = the full-logits path."""
        if self.loss_chunk_tokens is not None:
            return self.loss_chunk_tokens
        return AUTO_LOSS_CHUNK_TOKENS if vocab_size >= AUTO_LOSS_CHUNK_MIN_VOCAB else 0

    def ramp_points(self) -> list[tuple[int, int]]:
        """The step size as (first optimizer step, sequences) points, the last at ``global_batch_size``; one point
        (0, ``global_batch_size``) without a ramp."""
        if self.batch_ramp:
            return [(p.step, p.size) for p in self.batch_ramp]
        if self.batch_ramp_start_size <= 0 or self.batch_ramp_start_size >= self.global_batch_size:
            return [(0, self.global_batch_size)]
        sizes = range(self.batch_ramp_start_size, self.global_batch_size, max(self.batch_ramp_increment, 1))
        points = [(k * self.batch_ramp_steps_per_increment, size) for k, size in enumerate(sizes)]
        return points + [(len(points) * self.batch_ramp_steps_per_increment, self.global_batch_size)]

    def validate(self) -> None:
        positive(self, "max_steps", "global_batch_size", "micro_batch_size", "max_consecutive_skips")
        self._validate_ramp()
        non_negative(self, "eval_every_steps", "early_stopping_patience", "early_stopping_min_delta")
        if self.loss_chunk_tokens is not None:
            non_negative(self, "loss_chunk_tokens")
        non_negative(self, "z_loss")
        if self.compile not in typing.get_args(CompileMode):
            raise fail(f"train.compile={self.compile!r} is not allowed. Choose one of: "
                       f"{', '.join(typing.get_args(CompileMode))}.")
        if not 0.0 <= self.ema_decay < 1.0:
            raise fail(f"train.ema_decay={self.ema_decay} must be in [0, 1): e.g. 0.999 averages over about 1,000 "
                       "optimizer steps; 0 turns the weight EMA off.")


@dataclass
class SpikeConfig:
    """Loss-spike detection and rollback (``lmrecipe/train/callbacks/spikes.py``): off by default."""

    enabled: bool = False
    """Watch every step's loss (mean over ranks) and gradient norm; on a spike, reload the last checkpoint, skip the
    samples of the flagged steps for good, and continue. A spike is acted on at the next sync point (a logged,
    evaluated or saved step), so within ``logging.log_every_steps`` steps."""
    window: int = 100
    """Trailing optimizer steps (those not flagged) whose loss mean and standard deviation a step is compared with."""
    min_history: int = 20
    """Steps the window must hold before the z-score rule applies (non-finite values count from the first step)."""
    z_threshold: float = 6.0
    """A step whose loss is more than this many standard deviations above the window's mean is a spike."""
    grad_norm_z_threshold: Optional[float] = None
    """The same rule on the pre-clip gradient norm; null = the gradient norm only counts when not finite."""
    max_rollbacks: int = 5
    """Rollbacks allowed over the run; the next spike stops it with exit code 2."""

    def validate(self) -> None:
        positive(self, "window", "min_history", "z_threshold", "max_rollbacks")
        if self.min_history < 2:
            raise fail(f"spike.min_history={self.min_history} must be at least 2 (a standard deviation needs two steps).")
        if self.grad_norm_z_threshold is not None and self.grad_norm_z_threshold <= 0:
            raise fail(f"spike.grad_norm_z_threshold={self.grad_norm_z_threshold} must be positive (or null).")
