"""Fault injection for tests, installed in one place from the environment (read once, at start-up).

- ``LMRECIPE_FAULT_OOM_AT_STEP=N``: the model's forward raises ``torch.OutOfMemoryError`` in optimizer step N
  (1-based), so the real out-of-memory diagnosis runs on a CPU.
- ``LMRECIPE_FAULT_SPIKE_STEPS=N[,M...]``: the logits are multiplied by 1000 whenever the model's input is one of
  those steps' micro-batches (in the order without skips), so the fault follows the samples, as bad data does,
  wherever a rollback moves them; it logs each time it fires.
- ``LMRECIPE_FAULT_SLOW_RANK=R:SECONDS[:STEP]``: rank R sleeps SECONDS before each forward of the model (from
  optimizer step STEP on, 1-based; from the start without it), a rank whose device computes slower than the others'
  (the straggler instrument names it: ``docs/hangs.md``).

Production code knows nothing of them: the :class:`FaultInjection` callback, present only when one of them is set,
is the only entry point.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Callable

import torch

from lmrecipe.train.callback import Callback

logger = logging.getLogger(__name__)

OOM_FAULT_ENV = "LMRECIPE_FAULT_OOM_AT_STEP"
SPIKE_FAULT_ENV = "LMRECIPE_FAULT_SPIKE_STEPS"
SLOW_RANK_FAULT_ENV = "LMRECIPE_FAULT_SLOW_RANK"
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
        model = run.accelerator.unwrap_model(run.model)
        maybe_install_faults(model, run.train_batches, lambda: trainer.running_step)
        maybe_slow_rank(model, run.accelerator.process_index, lambda: trainer.running_step)


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
