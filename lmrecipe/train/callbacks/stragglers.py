"""The straggler instrument's clock (``distributed.stragglers``, ``docs/hangs.md``): every micro-batch's forward timed
on every rank, read at logged steps only, and handed to the step's reduction as one vector
(:attr:`StepResult.rank_compute_s`); the reporter (``lmrecipe/observe/console.py``) names a rank that stays slow.
"""

from __future__ import annotations

from lmrecipe.observe.console import log_due
from lmrecipe.observe.stragglers import ComputeClock, rank_vector
from lmrecipe.train.callback import Callback
from lmrecipe.train.step import StepResult


class StragglerClock(Callback):
    """Puts a :class:`ComputeClock` on the run (``forward_backward_step`` times each forward with it) and, at a logged
    step, reads it into the step's result. An unlogged step only records events (no host sync)."""

    def attach(self, trainer) -> None:
        run = trainer.run
        self.logging = run.cfg.logging
        self.rank, self.world_size = run.accelerator.process_index, run.accelerator.num_processes
        self.clock = run.compute_clock = ComputeClock(run.accelerator.device)

    def after_step(self, trainer, result: StepResult) -> None:
        if log_due(self.logging, trainer.state.step, trainer.max_steps):
            result.rank_compute_s = rank_vector(self.clock.take_s(), self.rank, self.world_size)

    def after_rollback(self, trainer) -> None:
        self.clock.take_s()  # the steps a rollback discarded are not the next row's

    def on_close(self, trainer) -> None:
        trainer.run.compute_clock = None
