"""The training state a resume needs besides weights and optimizer state: step, tokens, skip counters, wall time.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

logger = logging.getLogger(__name__)

@dataclass
class TrainState:
    """Everything besides weights and optimizer state that a resume needs; saved as JSON in each checkpoint.

    Skipped updates are counted on the device as steps go (reading a flag would stall a GPU every step) and
    folded into the fields by :meth:`sync`, which the loop calls at its sync points (log, eval, save, end).
    """

    step: int = 0
    """Optimizer steps completed (the next step to run)."""
    tokens_seen: int = 0
    """Training tokens consumed over all ranks."""
    best_val_loss: float | None = None
    skipped_steps: int = 0
    """Updates skipped for a non-finite loss or gradient norm, over the run (as of the last sync)."""
    consecutive_skips: int = 0
    """Skipped updates in a row up to the last sync."""
    last_val_loss: float | None = None
    last_val_step: int | None = None
    """Step of the latest evaluation (a checkpoint saved at that step is ranked by its loss)."""
    last_val_loss_ema: float | None = None
    """Validation loss of the weight EMA at the latest evaluation (None without ``train.ema_decay``)."""
    evals_without_improvement: int = 0
    """Evaluations in a row whose loss was not below the best before by more than ``train.early_stopping_min_delta``."""
    wall_time_s: float = 0.0
    """Seconds of training over all sessions of the run (as of the last step), for the report's device-hours."""
    skipped_batches: list[int] = field(default_factory=list)
    """Data steps (blocks of ``train.global_batch_size`` samples of the original order) never trained on, because a
    loss spike was rolled back (``lmrecipe/spikes.py``); ascending. Step s reads the s-th data step not listed."""
    rollbacks: int = 0
    """Rollbacks after loss spikes over the run."""
    spike_window: list | None = None
    """The spike rule's window of recent steps' ``[loss, grad_norm]`` (as of the last sync), so a resume judges alike."""

    def __post_init__(self):
        self._pending: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def record_step(self, skipped: torch.Tensor | bool, tokens: int) -> None:
        """Count one optimizer step; ``skipped`` may be a device tensor (no sync) or a bool."""
        self.step += 1
        self.tokens_seen += tokens
        skipped = torch.as_tensor(skipped).long()
        if self._pending is None:
            zero = torch.zeros((), dtype=torch.long, device=skipped.device)
            self._pending = (zero, zero + self.consecutive_skips, zero + self.consecutive_skips)
        total, run, longest = self._pending
        skipped = skipped.to(total.device, non_blocking=True)
        run = (run + 1) * skipped  # length of the current run of skips, 0 after an applied update
        self._pending = (total + skipped, run, torch.maximum(longest, run))

    def sync(self) -> int:
        """Fold the device counters into the fields (one host read); return the longest run of skips since."""
        if self._pending is None:
            return self.consecutive_skips
        total, run, longest = torch.stack(self._pending).tolist()
        self.skipped_steps += total
        self.consecutive_skips = run
        self._pending = None
        return longest

    def record_eval(self, val_loss: float, min_delta: float = 0.0) -> None:
        self.last_val_loss, self.last_val_step = val_loss, self.step
        improved = self.best_val_loss is None or val_loss < self.best_val_loss - min_delta
        self.evals_without_improvement = 0 if improved else self.evals_without_improvement + 1
        self.best_val_loss = val_loss if self.best_val_loss is None else min(self.best_val_loss, val_loss)
