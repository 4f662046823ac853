"""``profile.first_step``..: ``torch.profiler`` around those steps' ``train_step`` (``lmrecipe/observe/profiler.py``)."""

from __future__ import annotations

import contextlib
from pathlib import Path

from lmrecipe.config import ProfileConfig
from lmrecipe.observe.profiler import StepProfiler
from lmrecipe.train.callback import Callback


class StepProfiling(Callback):
    """Opens the profiler's context for a step before ``train_step`` and closes it right after, first among the
    callbacks, so what is profiled is the step itself."""

    order = 10

    def __init__(self, section: ProfileConfig, out_dir: Path, accelerator):
        self.profiler = StepProfiler(section, out_dir, rank=accelerator.process_index,
                                     is_main=accelerator.is_main_process, barrier=accelerator.wait_for_everyone)
        self._open = contextlib.ExitStack()

    def before_step(self, trainer) -> None:
        self._open.enter_context(self.profiler.step(trainer.running_step))

    def after_step(self, trainer, result) -> None:
        self._open.close()
