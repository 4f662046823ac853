"""The session's time account (``out_dir/goodput.json``, ``lmrecipe/observe/goodput.py``), kept on the main process:
start-up until the first step, each step's time and data wait, evaluations, checkpoints and rolled-back steps;
rewritten at every logged step, after every checkpoint and when the trainer closes. Host clocks only: no host sync.
"""

from __future__ import annotations

import logging
import time

from lmrecipe.observe.console import log_due
from lmrecipe.observe.goodput import GOODPUT_FILE, SessionLedger, process_start
from lmrecipe.train.callback import Callback, EvalResult
from lmrecipe.train.step import StepResult

logger = logging.getLogger(__name__)


class GoodputLedger(Callback):
    """Marks the loop's points with the host clock. It comes before the callbacks whose time it measures (the
    checkpoint's save at ``on_save``, the evaluation's figures at ``eval_figures``); the wait between two marks is
    charged to what ran between them."""

    def attach(self, trainer) -> None:
        self.out_dir = trainer.out_dir
        self.logging = trainer.run.cfg.logging
        self.enabled = trainer.run.accelerator.is_main_process
        self.ledger: SessionLedger | None = None
        self._mark: tuple[str, float] | None = None  # (what runs since, when it began)

    def before_step(self, trainer) -> None:
        if self.enabled and self.ledger is None:  # the session's first step, after the resume
            self.ledger = SessionLedger(trainer.state.step, process_start())
            self._mark = ("startup_s", self.ledger.entry["started_at"])
        self._charge(None)

    def on_step_end(self, trainer, result: StepResult) -> None:
        if self.ledger is None:
            return
        self.ledger.step_done(trainer.state.step, trainer.step_time_s, result.data_time_s)
        if log_due(self.logging, trainer.state.step, trainer.max_steps):
            self._write()

    def eval_figures(self, trainer, evaluate) -> dict[str, float]:
        self._charge("eval_s")
        return {}

    def after_eval(self, trainer, result: EvalResult) -> None:
        self._charge(None)

    def on_save(self, trainer) -> None:
        step = trainer.state.step
        if self.ledger is not None and (trainer.checkpointer.due(step) or (trainer.stop is not None and trainer.stop.save)):
            self._charge("checkpoint_s")
            self.ledger.saved(step)

    def on_end(self, trainer) -> None:
        self._charge(None)  # the last step's checkpoint; the end's export and report are other time

    def after_rollback(self, trainer) -> None:
        if self.ledger is not None:
            self.ledger.rolled_back(trainer.state.step)

    def on_close(self, trainer) -> None:
        self._charge(None)
        if self.ledger is not None:
            self._write()

    def _write(self) -> None:
        """Rewrite goodput.json; a full or failing disk costs the account, not the run (nor the error that ends it)."""
        try:
            self.ledger.write(self.out_dir)
        except OSError as err:
            logger.warning("%s not updated: %s", self.out_dir / GOODPUT_FILE, err)

    def _charge(self, next_kind: str | None) -> None:
        """Charge the time since the last mark to its kind, then start ``next_kind`` (None: nothing is timed)."""
        if self.ledger is None:
            return
        now = time.time()
        if self._mark is not None:
            kind, since = self._mark
            self.ledger.add(kind, now - since)
            if kind == "checkpoint_s":
                self._write()
        self._mark = None if next_kind is None else (next_kind, now)
