"""Evaluation: the validation loss every ``train.eval_every_steps`` steps and at the last, after the step's log line.

Each evaluation asks the callbacks for their figures first (``eval_figures``: the weight EMA's loss, the tasks'
accuracy), then measures the validation loss of the trained weights (per source of a mixture), records it in the
training state, and hands the whole to every callback's ``after_eval`` (the log, early stopping).
"""

from __future__ import annotations

from lmrecipe.config import due_at
from lmrecipe.loss import validation_loss
from lmrecipe.train.callback import Callback, EvalResult
from lmrecipe.train.setup import Run


class Evaluation(Callback):
    order = 130

    def __init__(self, run: Run):
        self.run = run
        self.every_steps = run.cfg.train.eval_every_steps
        self.max_steps = run.cfg.train.max_steps

    def needs_sync(self, trainer, step: int) -> bool:
        return due_at(step, self.every_steps, self.max_steps)

    def on_step_end(self, trainer, result) -> None:
        if self.needs_sync(trainer, trainer.state.step):
            self.evaluate(trainer)

    def _losses(self) -> dict[str, float]:
        run = self.run
        return {name: validation_loss(run.model, batches, run.accelerator, run.attention)
                for name, batches in run.data.val_sets.items()}

    def evaluate(self, trainer) -> EvalResult:
        data = self.run.data
        figures = trainer.figures("eval_figures", lambda: data.val_loss(self._losses()))
        per_source = self._losses()
        val_loss = data.val_loss(per_source)
        best_before = trainer.state.best_val_loss
        trainer.state.record_eval(val_loss)
        result = EvalResult(val_loss, best_before, per_source if data.is_mixture else None, figures)
        trainer.call("after_eval", result)
        return result
