"""The training state a resume needs besides weights and optimizer state: step, tokens, skip counters, wall time.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

@dataclass
class TrainState:
    """The core of what a resume needs besides weights and optimizer state; saved as JSON in each checkpoint.

    The trainer's callbacks keep their own state (the spike rule's window, early stopping's counter, the weight EMA),
    which the checkpoint saves beside this one by name.

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
    wall_time_s: float = 0.0
    """Seconds of training over all sessions of the run (as of the last step), for the report's device-hours."""

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

    def state_dict(self) -> dict:
        """The fields as saved in ``train_state.json`` (``state``); call :meth:`sync` first to include recent skips."""
        return {"step": self.step, "tokens_seen": self.tokens_seen, "best_val_loss": self.best_val_loss,
                "skipped_steps": self.skipped_steps, "consecutive_skips": self.consecutive_skips,
                "last_val_loss": self.last_val_loss, "last_val_step": self.last_val_step,
                "wall_time_s": self.wall_time_s}

    def load_state_dict(self, saved: dict) -> None:
        """Take a checkpoint's ``state``; a field a checkpoint of earlier code lacks keeps its default."""
        fresh = TrainState()
        self.step = int(saved.get("step", fresh.step))
        self.tokens_seen = int(saved.get("tokens_seen", fresh.tokens_seen))
        self.best_val_loss = _optional_float(saved.get("best_val_loss"))
        self.skipped_steps = int(saved.get("skipped_steps", fresh.skipped_steps))
        self.consecutive_skips = int(saved.get("consecutive_skips", fresh.consecutive_skips))
        self.last_val_loss = _optional_float(saved.get("last_val_loss"))
        self.last_val_step = None if saved.get("last_val_step") is None else int(saved["last_val_step"])
        self.wall_time_s = float(saved.get("wall_time_s", fresh.wall_time_s))
        self._pending = None

    def record_eval(self, val_loss: float) -> None:
        """An evaluation at this step."""
        self.last_val_loss, self.last_val_step = val_loss, self.step
        self.best_val_loss = val_loss if self.best_val_loss is None else min(self.best_val_loss, val_loss)


def _optional_float(value) -> float | None:
    return None if value is None else float(value)
