"""Fault injection for tests, installed in one place from the environment (read once, at start-up).

- ``LMRECIPE_FAULT_OOM_AT_STEP=N``: the model's forward raises ``torch.OutOfMemoryError`` in optimizer step N
  (1-based), so the real out-of-memory diagnosis runs on a CPU.
- ``LMRECIPE_FAULT_SPIKE_STEPS=N[,M...]``: the logits are multiplied by 1000 whenever the model's input is one of
  those steps' micro-batches (in the order without skips), so the fault follows the samples, as bad data does,
  wherever a rollback moves them; it logs each time it fires.
- ``LMRECIPE_FAULT_SLOW_RANK=R:SECONDS[:STEP]``: rank R sleeps SECONDS before each forward of the model (from
  optimizer step STEP on, 1-based; from the start without it), a rank whose device computes slower than the others'
  (the straggler instrument names it: ``docs/hangs.md``).
- ``LMRECIPE_MAX_STEPS=N``: a session trains at most N optimizer steps: ``train.max_steps`` is lowered to the step it
  starts from (its resume or branch checkpoint's, else 0) plus N, and the log says so. The test of the documentation's
  commands runs every training command under it, unedited.

Production code knows nothing of them: the :class:`FaultInjection` callback, present only when one of them is set,
is the only entry point of the faults, and :func:`maybe_cap_steps` (called by ``train()``) that of the step cap.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from pathlib import Path
from typing import Callable

import torch

from lmrecipe.checkpoint.storage import find_resume_checkpoint, read_checkpoint
from lmrecipe.errors import UserError, fail
from lmrecipe.parallel.accelerator import unwrap_model
from lmrecipe.train.callback import Callback

logger = logging.getLogger(__name__)

OOM_FAULT_ENV = "LMRECIPE_FAULT_OOM_AT_STEP"
SPIKE_FAULT_ENV = "LMRECIPE_FAULT_SPIKE_STEPS"
SLOW_RANK_FAULT_ENV = "LMRECIPE_FAULT_SLOW_RANK"
MAX_STEPS_ENV = "LMRECIPE_MAX_STEPS"
_SPIKE_LOGIT_SCALE = 1000.0


class FaultInjection(Callback):
    """Attaches the faults the environment asks for to the model when the run starts (after a resume)."""

    @classmethod
    def from_environment(cls) -> FaultInjection | None:
        """The callback when a fault variable is set, else None."""
        if not any(os.environ.get(name, "").strip() for name in (OOM_FAULT_ENV, SPIKE_FAULT_ENV, SLOW_RANK_FAULT_ENV)):
            return None
        return cls()

    def on_start(self, trainer) -> None:
        run = trainer.run
        model = unwrap_model(run.accelerator, run.model)
        maybe_install_faults(model, run.train_batches, lambda: trainer.running_step)
        maybe_slow_rank(model, run.accelerator.process_index, lambda: trainer.running_step)


def maybe_cap_steps(cfg, out_dir: Path):
    """``cfg`` with ``train.max_steps`` lowered to the session's start step plus ``LMRECIPE_MAX_STEPS``, when that is
    set and lower; else ``cfg`` itself. Reads checkpoint files only: every rank answers alike."""
    value = os.environ.get(MAX_STEPS_ENV, "").strip()
    if not value:
        return cfg
    if not value.isdigit() or int(value) < 1:
        raise fail(f"{MAX_STEPS_ENV}={value!r} is not a number of optimizer steps (a whole number, at least 1): set "
                   "it to the most steps a session may train, or unset it to train to train.max_steps.")
    start = _start_step(cfg, out_dir)
    capped = min(cfg.train.max_steps, start + int(value))
    if capped == cfg.train.max_steps:
        return cfg
    logger.warning("%s=%s: train.max_steps capped from %d to %d (this session starts at step %d)", MAX_STEPS_ENV,
                   value, cfg.train.max_steps, capped, start)
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, max_steps=capped))


def _start_step(cfg, out_dir: Path) -> int:
    """The step the run resumes from (its own newest checkpoint, or the branch source before it has one); 0 for a
    fresh start or a checkpoint the resume itself will refuse with its own message."""
    try:
        checkpoint = find_resume_checkpoint(cfg.checkpoint.resume, out_dir / "checkpoints")
        if checkpoint is None and cfg.checkpoint.branch_from:
            checkpoint = find_resume_checkpoint(cfg.checkpoint.branch_from, out_dir / "checkpoints")
        return int(read_checkpoint(checkpoint)["state"]["step"]) if checkpoint is not None else 0
    except UserError:
        return 0


def maybe_install_faults(model: torch.nn.Module, batches, current_step: Callable[[], int | None]) -> None:
    """Attach the faults the environment asks for to ``model`` (the unwrapped module).

    ``batches``: the training batches (the spike fault matches their inputs); ``current_step``: the optimizer step
    (1-based) running now, or None between steps (the out-of-memory guard's).
    """
    oom_step = os.environ.get(OOM_FAULT_ENV, "").strip()
    if oom_step:
        _attach_oom(model, int(oom_step), current_step)
    spike_steps = [int(v) for v in os.environ.get(SPIKE_FAULT_ENV, "").split(",") if v.strip()]
    if spike_steps:
        faulted = [inputs for step in spike_steps for inputs in batches.data_step_inputs(step - 1)]
        _attach_spike(model, faulted)


def maybe_slow_rank(model: torch.nn.Module, rank: int, current_step: Callable[[], int | None]) -> None:
    """``LMRECIPE_FAULT_SLOW_RANK=R:SECONDS[:STEP]``: on rank R, every forward of ``model`` in optimizer step STEP
    (1-based) or later starts SECONDS late."""
    value = os.environ.get(SLOW_RANK_FAULT_ENV, "").strip()
    if not value:
        return
    slow_rank, seconds, from_step = (value.split(":") + ["1"])[:3]
    if int(slow_rank) != rank:
        return
    logger.warning("Slowing every forward of rank %d by %s s from step %s (%s)", rank, seconds, from_step,
                   SLOW_RANK_FAULT_ENV)

    def before(module, args):
        if (current_step() or 0) >= int(from_step):
            time.sleep(float(seconds))

    model.register_forward_pre_hook(before)


def _attach_oom(model: torch.nn.Module, step: int, current_step: Callable[[], int | None]) -> None:
    def before(module, args):
        if current_step() == step:
            raise torch.OutOfMemoryError(f"out of memory (injected by {OOM_FAULT_ENV}={step})")

    model.register_forward_pre_hook(before)


def _attach_spike(model: torch.nn.Module, faulted: list[torch.Tensor]) -> None:
    hit = {"now": False}

    def before(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        hit["now"] = ids is not None and any(ids.shape == f.shape and torch.equal(ids.cpu(), f) for f in faulted)

    def after(module, args, kwargs, output):
        if hit["now"]:
            logger.warning("Injecting a loss spike (%s): logits x %g for these samples", SPIKE_FAULT_ENV,
                           _SPIKE_LOGIT_SCALE)
            output.logits = output.logits * _SPIKE_LOGIT_SCALE
        return output

    model.register_forward_pre_hook(before, with_kwargs=True)
    model.register_forward_hook(after, with_kwargs=True)
