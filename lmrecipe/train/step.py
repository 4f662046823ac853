"""One optimizer step in two halves, with no host synchronisation: :func:`forward_backward` (every micro-batch's
forward and backward, gradients accumulated) and :func:`optim_step` (clip, update, zero the gradients).

Between the two the gradients of the whole step are complete and not yet consumed: the trainer
(``lmrecipe/train/trainer.py``) calls its callbacks' ``pre_optim_step`` there. Under DeepSpeed, Accelerate's
``accelerator.backward`` would step the engine inside the last micro-batch's backward; here the engine's own backward
runs at Accelerate's accumulation boundary and its step in :func:`optim_step`, the same calls in the same order.
:func:`train_step` is the two halves together, for the benchmarks that time a step without the trainer.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from lmrecipe.model.loss import LossTerms, forward_kwargs, training_loss
from lmrecipe.observe.profiler import region
from lmrecipe.optim import set_lr
from lmrecipe.train.setup import Run

logger = logging.getLogger(__name__)


@dataclass
class StepResult:
    """What one optimizer step produced. The tensors stay on the device: reading one is a host sync."""

    loss: torch.Tensor
    """Mean language-model loss of this rank's micro-batches (the z-loss apart)."""
    lr: float
    grad_norm: torch.Tensor | float
    """Global gradient norm before clipping."""
    skipped: torch.Tensor | bool
    """The update was skipped (non-finite loss or gradient norm)."""
    data_time_s: float
    """Seconds the step waited for its batches (prefetched in the background) and their copy to the device."""
    tokens: int | None = None
    """Training tokens of this step over all ranks (a batch-size ramp's size x ``data.seq_len``); None: a step of
    ``train.global_batch_size`` (``Run.tokens_per_step``)."""
    z_loss: torch.Tensor | None = None
    """Mean z-loss term of this rank's micro-batches (``train.z_loss``, already times its coefficient); None: off."""
    aux_loss: torch.Tensor | None = None
    """Mean router load-balancing term of this rank's micro-batches (``model.router_aux_loss_coef`` times the model's
    auxiliary loss); None: a dense model or off."""
    expert_tokens: torch.Tensor | None = None
    """Tokens this rank routed to each expert of each MoE layer over the step, ``[layers, experts]``; None: dense."""
    rank_compute_s: torch.Tensor | None = None
    """At a logged step: this rank's forward seconds over the log interval at its place of a ``[world_size]`` vector
    of zeros (``lmrecipe/observe/stragglers.py``), summed over ranks in the step's reduction; None: not timed."""
    figures: dict = field(default_factory=dict)
    """Further figures of a logged step by name, on the device and already combined over ranks (the per-layer
    instruments' ``grad_norm/<part>``, ...: ``lmrecipe/train/callbacks/layer_stats.py``), written with the step's row."""


SectionTimer = Callable[[str, float], None]
"""Receives (section name, seconds) from ``train_step`` when a benchmark asks for the split of a step."""


def forward_backward_step(run: Run, inputs: torch.Tensor, targets: torch.Tensor, timer: SectionTimer | None = None,
                          model_kwargs: dict | None = None) -> LossTerms:
    """Loss and gradients of one micro-batch (accumulated): the language-model loss, the z-loss term (None when
    ``train.z_loss`` is 0) and an MoE model's router term (None for a dense model), detached; their sum is
    backpropagated. No update happens here, under DeepSpeed either (:func:`backward`).

    ``model_kwargs``: the forward's document keywords (``loss.forward_kwargs``), already on the device.
    """
    accelerator, model = run.accelerator, run.model
    with accelerator.accumulate(model):
        start = time.perf_counter()
        clock = run.compute_clock
        with region("forward"):
            if clock is not None:
                clock.start()
            moe = run.cfg.model
            terms = training_loss(model, inputs, targets, run.cfg.train.z_loss, model_kwargs,
                                  moe.router_aux_loss_coef if moe.is_moe() else 0.0, run.router_loads)
            objective = terms.objective()
            if clock is not None:
                clock.stop()
        forward_done = time.perf_counter()
        with region("backward"):
            # Sequence parallelism: scaled to how DeepSpeed reduces the group's gradients (SequenceParallel).
            sequence = run.runtime.sequence
            backward(run, objective if sequence is None else objective / sequence.loss_divisor)
    if timer is not None:
        timer("forward+loss", forward_done - start)
        timer("backward", time.perf_counter() - forward_done)
    return LossTerms(*(None if term is None else term.detach() for term in terms))


def backward(run: Run, objective: torch.Tensor) -> None:
    """``accelerator.backward`` without its DeepSpeed step: under DeepSpeed the engine's backward, told whether this
    micro-batch ends Accelerate's accumulation (the engine reduces the gradients there), as Accelerate's wrapper does
    before it calls ``engine.step``; :func:`optim_step` makes that call."""
    accelerator = run.accelerator
    if not run.runtime.topology.zero.deepspeed:
        accelerator.backward(objective)
        return
    engine = run.model
    engine.set_gradient_accumulation_boundary(is_boundary=accelerator.sync_gradients)
    engine.backward(objective)


def optimizer_step(model, optimizer, accelerator, grad_clip: float, deepspeed: bool) -> tuple[torch.Tensor | float, torch.Tensor | bool]:
    """Clip and step, or skip a non-finite update, then zero the gradients. Returns the pre-clip global grad norm and
    whether it skipped.

    Without DeepSpeed nothing here reads a tensor on the host: the norm stays on the device, and the fused
    AdamW receives the skip decision as a device flag (``found_inf``, the mechanism GradScaler uses), so a
    non-finite gradient leaves weights, moments and step counts untouched without the CPU waiting for it.
    """
    if deepspeed:
        # The engine clips, updates and zeroes the gradients in its step, and skips the update itself when the
        # gradients are not finite.
        skipped_before = model.skipped_steps
        model.step()
        norm = model.get_global_grad_norm()
        norm = torch.as_tensor(float("nan") if norm is None else norm)
        return norm, ~torch.isfinite(norm) | (model.skipped_steps > skipped_before)
    norm = accelerator.clip_grad_norm_(model.parameters(), grad_clip if grad_clip > 0 else float("inf"))
    if accelerator.scaler is not None:
        # fp16: the GradScaler must see every step, so it can skip an overflow and lower the scale (it syncs).
        optimizer.step()
        skipped = optimizer.step_was_skipped
    else:
        skipped = ~torch.isfinite(norm)
        inner = optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer
        if getattr(inner, "_step_supports_amp_scaling", False):
            inner.grad_scale, inner.found_inf = None, skipped.float()
            optimizer.step()
            inner.found_inf = None
        elif not skipped.item():  # an optimizer without device-side skipping (not the recipe's)
            optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm, skipped


@dataclass
class Gradients:
    """What :func:`forward_backward` leaves for :func:`optim_step`: the step's figures so far (device tensors); the
    gradients themselves sit in the model (its ``.grad`` fields, or DeepSpeed's partitions under ZeRO)."""

    lr: float
    samples: int
    """Sequences of this step over all ranks."""
    micro_batches: int
    loss_sum: torch.Tensor
    z_loss_sum: torch.Tensor | None
    aux_loss_sum: torch.Tensor | None
    expert_tokens: torch.Tensor | None
    data_time_s: float


def forward_backward(run: Run, step: int, timer: SectionTimer | None = None) -> Gradients:
    """The first half of optimizer step ``step`` (0-based): set its learning rate, then every micro-batch's forward and
    backward. The batches of the next step are assembled in the background meanwhile."""
    samples = run.train_batches.step_size(step)
    run.accumulate_to(samples)  # a batch-size ramp: this step's accumulation count
    lr = run.lr_at(step)
    set_lr(run.optimizer, lr)
    device = run.accelerator.device
    fetch_start = time.perf_counter()
    with region("data"):
        micro_batches = run.prefetcher.get(step)
    data_time_s = time.perf_counter() - fetch_start
    loss_sum = torch.zeros((), device=device)
    z_loss_sum = aux_loss_sum = expert_tokens = None
    sequence = run.runtime.sequence
    for inputs, targets, documents in micro_batches:
        copy_start = time.perf_counter()
        with region("data"):
            model_kwargs = forward_kwargs(run.attention, documents, device)
            if sequence is not None:  # this rank's share of each window (sequence parallelism)
                inputs, targets, model_kwargs = sequence.shard(inputs, targets, model_kwargs, device)
            inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        data_time_s += time.perf_counter() - copy_start
        terms = forward_backward_step(run, inputs, targets, timer, model_kwargs)
        loss_sum += terms.lm
        z_loss_sum = _add(z_loss_sum, terms.z)
        aux_loss_sum = _add(aux_loss_sum, terms.aux)
        expert_tokens = _add(expert_tokens, terms.expert_tokens)
    return Gradients(lr, samples, len(micro_batches), loss_sum, z_loss_sum, aux_loss_sum, expert_tokens, data_time_s)


def optim_step(run: Run, gradients: Gradients, timer: SectionTimer | None = None) -> StepResult:
    """The second half: clip, update the weights (or skip a non-finite update), zero the gradients."""
    optimizer_start = time.perf_counter()
    with region("optimizer"):
        grad_norm, skipped = optimizer_step(run.model, run.optimizer, run.accelerator, run.cfg.optim.grad_clip,
                                            run.runtime.topology.zero.deepspeed)
    if timer is not None:
        timer("data", gradients.data_time_s)
        timer("clip+optimizer", time.perf_counter() - optimizer_start)
    n = gradients.micro_batches
    return StepResult(gradients.loss_sum / n, gradients.lr, grad_norm, skipped, gradients.data_time_s,
                      tokens=gradients.samples * run.cfg.data.seq_len,
                      z_loss=None if gradients.z_loss_sum is None else gradients.z_loss_sum / n,
                      aux_loss=None if gradients.aux_loss_sum is None else gradients.aux_loss_sum / n,
                      expert_tokens=gradients.expert_tokens)


def train_step(run: Run, step: int, timer: SectionTimer | None = None) -> StepResult:
    """Optimizer step ``step`` (0-based) whole: :func:`forward_backward`, then :func:`optim_step`."""
    return optim_step(run, forward_backward(run, step, timer), timer)


def _add(total: torch.Tensor | None, term: torch.Tensor | None) -> torch.Tensor | None:
    """A running sum of an optional loss term (None while no term has come)."""
    if term is None:
        return total
    return term.clone() if total is None else total + term
