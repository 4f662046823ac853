"""``profile.first_step``..: ``torch.profiler`` around those steps' ``train_step`` (``lmrecipe/observe/profiler.py``)."""

from __future__ import annotations

import contextlib

from lmrecipe.config import ProfileConfig
from lmrecipe.observe.profiler import StepProfiler
from lmrecipe.train.callback import Callback


class StepProfiling(Callback):
    """Opens the profiler's context for a step before ``train_step`` and closes it right after, first among the
    callbacks, so what is profiled is the step itself."""

    def __init__(self, section: ProfileConfig):
        self.section = section
        self.profiler: StepProfiler | None = None
        self._open = contextlib.ExitStack()

    def attach(self, trainer) -> None:
        accelerator = trainer.run.accelerator
        self.profiler = StepProfiler(self.section, trainer.out_dir, rank=accelerator.process_index,
                                     is_main=accelerator.is_main_process, barrier=accelerator.wait_for_everyone)

    def before_step(self, trainer) -> None:
        self._open.enter_context(self.profiler.step(trainer.running_step))

    def after_step(self, trainer, result) -> None:
        self._open.close()
