"""Rules that end a run before ``train.max_steps``: early stopping, and too many non-finite updates in a row."""

from __future__ import annotations

from lmrecipe.config import TrainConfig
from lmrecipe.train.callback import Callback, EvalResult, Stop


class NonFiniteStop(Callback):
    """``train.max_consecutive_skips`` updates in a row skipped for a non-finite loss or gradient norm stop the run
    (exit code 2); the skip counters are the training state's, read at sync points."""

    follows = ("SpikeGuard",)  # a spike's rollback at a sync point goes first: the steps it undoes are not counted

    def __init__(self, section: TrainConfig):
        self.limit = section.max_consecutive_skips
        self.z_loss = section.z_loss

    def at_sync(self, trainer, longest_skip_run: int) -> bool:
        if longest_skip_run >= self.limit:
            trainer.request_stop(Stop(
                f"Stopped at step {trainer.state.step}: {self.limit} or more consecutive updates were skipped because "
                "the loss or gradient norm was not finite (the weights were left unchanged). " + self.fixes() +
                " Then resume from the last checkpoint (checkpoint.resume=auto).", error=True))
        return False

    def fixes(self) -> str:
        """The ways out, the z-loss first when its coefficient is large enough to overflow on its own."""
        usual = ("a lower optim.lr, a longer schedule.warmup_steps, optim.grad_clip=1.0, or train.precision=bf16/fp32 "
                 "instead of fp16")
        if self.z_loss > Z_LOSS_LARGE:
            return (f"train.z_loss={self.z_loss:g} is large: it adds z_loss * logsumexp(logits)^2 to the loss, which "
                    "overflows at this scale; set train.z_loss=1e-4 (PaLM's) or 0 to turn it off. Otherwise try "
                    f"{usual}.")
        return f"Try {usual}" + (f", or a lower train.z_loss (now {self.z_loss:g})." if self.z_loss > 0 else ".")


Z_LOSS_LARGE = 1e-2
"""A ``train.z_loss`` above this is named first when updates stop being finite (the usual values are 1e-5 to 1e-3)."""


class EarlyStopping(Callback):
    """``train.early_stopping_patience`` evaluations in a row without improvement end the run (cleanly: the export
    follows, taken from the best checkpoint).

    An evaluation improves when its loss is below the best before it by more than ``train.early_stopping_min_delta``.
    The counter is saved in every checkpoint (``extras.early_stopping``), so a resumed run stops at the step an
    uninterrupted one would.
    """

    name = "early_stopping"

    def __init__(self, section: TrainConfig):
        self.patience = section.early_stopping_patience
        self.min_delta = section.early_stopping_min_delta
        self.evals_without_improvement = 0
        """Evaluations in a row whose loss was not below the best before by more than the minimum delta."""

    def after_eval(self, trainer, result: EvalResult) -> None:
        best_before = result.best_before
        improved = best_before is None or result.val_loss < best_before - self.min_delta
        self.evals_without_improvement = 0 if improved else self.evals_without_improvement + 1
        if self.patience > 0 and self.evals_without_improvement >= self.patience:
            trainer.request_stop(Stop(
                f"Early stopping at step {trainer.state.step}: {self.evals_without_improvement} evaluations without "
                f"improvement (best val_loss {trainer.state.best_val_loss:.4f})."))

    def outcome(self, trainer) -> dict:
        return {"evals_without_improvement": self.evals_without_improvement}

    def state_dict(self) -> dict:
        return {"evals_without_improvement": self.evals_without_improvement}

    def load_state_dict(self, state: dict | None) -> None:
        self.evals_without_improvement = int((state or {}).get("evals_without_improvement", 0))
