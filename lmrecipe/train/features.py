"""Loop features: small objects that own their state and declare where in the loop they act.

The loop (``lmrecipe/train/loop.py``) runs, for every optimizer step::

    train_step -> after_step -> [sync point: host read, at_sync] -> log line -> [eval due: evaluate, after_eval]
               -> save (or save and exit on preemption) -> stop_reason

and calls each hook on the features in their list order. A feature overrides only the hooks it uses:

- ``after_step(state, result)``: every step, device work only (an unlogged step makes no host sync);
- ``at_sync(state, longest_skip_run) -> bool``: at a sync point (a logged, evaluated or saved step), after the
  skip counters were read; True means the feature moved the run back (a rollback) and the loop goes on from
  ``state.step`` without logging, evaluating or saving this step;
- ``eval_metrics(evaluate) -> dict``: before the validation loss of an evaluation, further figures for its metrics
  row, by name (``evaluate()`` returns the validation loss of the weights the model holds now; the weight EMA uses
  it, the multiple-choice tasks score their own items);
- ``after_eval(state, val_loss, best_before)``: after an evaluation;
- ``stop_reason(state) -> Stop | None``: after the step's save; the first feature that names a reason ends the run
  (cleanly, or with exit code 2 when ``Stop.error``).

A feature with a ``name`` hands its ``state_dict()`` (and ``save_files``/``load_files`` for tensors) to every
checkpoint under ``extras.<name>`` and is restored from it on resume and rollback, so a resumed run behaves as
the uninterrupted one would. Adding a feature means adding an object to :func:`lmrecipe.train.loop.build_features`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from lmrecipe.config import TrainConfig


@dataclass(frozen=True)
class Stop:
    """Why the run ends before ``train.max_steps``: ``error`` ends it with exit code 2 and ``message`` as the error."""

    message: str
    error: bool = False


class LoopFeature:
    """The hooks of the module docstring, each a no-op here."""

    name: str | None = None
    """Its key in the checkpoint's ``extras``; None: it keeps no state across a resume."""

    def after_step(self, state, result) -> None:
        pass

    def at_sync(self, state, longest_skip_run: int) -> bool:
        return False

    def eval_metrics(self, evaluate: Callable[[], float]) -> dict[str, float]:
        return {}

    def after_eval(self, state, val_loss: float, best_before: float | None) -> None:
        pass

    def stop_reason(self, state) -> Stop | None:
        return None


class Features:
    """The loop's features in order; each method calls one hook on all of them."""

    def __init__(self, features: Sequence[LoopFeature]):
        self.features = list(features)
        names = [f.name for f in self.features if f.name is not None]
        if len(names) != len(set(names)):
            raise ValueError(f"loop features share a checkpoint name: {names}")

    def __iter__(self):
        return iter(self.features)

    def get(self, kind: type) -> LoopFeature | None:
        return next((f for f in self.features if isinstance(f, kind)), None)

    def extras(self) -> dict[str, LoopFeature]:
        """The features with state, by name: what every checkpoint saves and a resume restores."""
        return {f.name: f for f in self.features if f.name is not None}

    def after_step(self, state, result) -> None:
        for feature in self.features:
            feature.after_step(state, result)

    def at_sync(self, state, longest_skip_run: int) -> bool:
        """True when a feature moved the run back (the others' hooks are not called for this step)."""
        return any(feature.at_sync(state, longest_skip_run) for feature in self.features)

    def eval_metrics(self, evaluate: Callable[[], float]) -> dict[str, float]:
        metrics: dict[str, float] = {}
        for feature in self.features:
            metrics.update(feature.eval_metrics(evaluate))
        return metrics

    def after_eval(self, state, val_loss: float, best_before: float | None) -> None:
        for feature in self.features:
            feature.after_eval(state, val_loss, best_before)

    def stop_reason(self, state) -> Stop | None:
        return next((stop for f in self.features if (stop := f.stop_reason(state)) is not None), None)


class EarlyStopping(LoopFeature):
    """``train.early_stopping_patience`` evaluations in a row without improvement end the run.

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
        self._evaluated_at: int | None = None

    def after_eval(self, state, val_loss: float, best_before: float | None) -> None:
        improved = best_before is None or val_loss < best_before - self.min_delta
        self.evals_without_improvement = 0 if improved else self.evals_without_improvement + 1
        self._evaluated_at = state.step

    def stop_reason(self, state) -> Stop | None:
        """After this step's evaluation: patience exhausted."""
        if self.patience <= 0 or self._evaluated_at != state.step or self.evals_without_improvement < self.patience:
            return None
        return Stop(f"Early stopping at step {state.step}: {self.evals_without_improvement} evaluations without "
                    f"improvement (best val_loss {state.best_val_loss:.4f}).")

    def state_dict(self) -> dict:
        return {"evals_without_improvement": self.evals_without_improvement}

    def load_state_dict(self, state: dict | None) -> None:
        self.evals_without_improvement = int((state or {}).get("evals_without_improvement", 0))


class NonFiniteStop(LoopFeature):
    """``train.max_consecutive_skips`` updates in a row skipped for a non-finite loss or gradient norm stop the run
    (exit code 2); the skip counters are the core training state's, read at sync points."""

    def __init__(self, limit: int):
        self.limit = limit
        self._longest = 0

    def at_sync(self, state, longest_skip_run: int) -> bool:
        self._longest = longest_skip_run
        return False

    def stop_reason(self, state) -> Stop | None:
        if self._longest < self.limit:
            return None
        return Stop(
            f"Stopped at step {state.step}: {self.limit} or more consecutive updates were skipped because the loss or "
            "gradient norm was not finite (the weights were left unchanged). Try a lower optim.lr, a longer "
            "schedule.warmup_steps, optim.grad_clip=1.0, or train.precision=bf16/fp32 instead of fp16, and resume "
            "from the last checkpoint (checkpoint.resume=auto).", error=True)
