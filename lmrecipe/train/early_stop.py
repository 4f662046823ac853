"""Early stopping: ``train.early_stopping_patience`` evaluations in a row without improvement end the run.

An evaluation improves when its loss is below the best before it by more than ``train.early_stopping_min_delta``.
The counter is this feature's own state, saved in every checkpoint (``extras.early_stopping``), so a resumed run
stops at the step an uninterrupted one would.
"""

from __future__ import annotations

from lmrecipe.config import TrainConfig


class EarlyStopping:
    def __init__(self, section: TrainConfig):
        self.patience = section.early_stopping_patience
        self.min_delta = section.early_stopping_min_delta
        self.evals_without_improvement = 0
        """Evaluations in a row whose loss was not below the best before by more than the minimum delta."""

    def record(self, val_loss: float, best_before: float | None) -> None:
        improved = best_before is None or val_loss < best_before - self.min_delta
        self.evals_without_improvement = 0 if improved else self.evals_without_improvement + 1

    def should_stop(self, evaluated_now: bool) -> bool:
        """After the evaluation of this step (``evaluated_now``): patience exhausted."""
        return self.patience > 0 and evaluated_now and self.evals_without_improvement >= self.patience

    def state_dict(self) -> dict:
        return {"evals_without_improvement": self.evals_without_improvement}

    def load_state_dict(self, state: dict | None) -> None:
        self.evals_without_improvement = int((state or {}).get("evals_without_improvement", 0))
