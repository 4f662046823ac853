"""The hang watchdog of a multi-process run (``docs/hangs.md``): every rank marks where its main thread is at each hook
and a thread names a rank stuck past its phase's budget (``lmrecipe/train/hang.py``), then ends the run (exit 3).

The phases, as the hooks mark them: ``start`` (the resume), ``forward/backward`` of step N (its batches included) from
``before_step``, ``optimizer`` from ``pre_optim_step``, ``step end`` from ``after_step`` (the sync point, the log
line), ``evaluation`` from ``eval_figures``, ``checkpoint`` at a save point that saves, ``export/end`` from
``on_end``, ``error`` from ``on_error``. A hook only assigns Python attributes: an unlogged step gains no host sync.

At the start every process group's timeout is set to ``distributed.timeout_s`` (``lmrecipe/parallel/timeouts.py``:
DeepSpeed's own groups otherwise wait torch's 30 minutes).
"""

from __future__ import annotations

import logging

from lmrecipe.config.sections import DistributedConfig
from lmrecipe.parallel.timeouts import bound_group_timeouts
from lmrecipe.train.callback import Callback, EvalResult
from lmrecipe.train.hang import (CHECKPOINT, END, ERROR, EVALUATION, FORWARD_BACKWARD, OPTIMIZER, START, STEP_END,
                                 Budgets, HangWatcher, ProgressBoard, launcher_store, store_prefix, this_peer)

logger = logging.getLogger(__name__)

_STORE_TIMEOUT_S = 30.0
"""How long one store request may wait (the watcher retries at its next beat)."""


class Watchdog(Callback):
    """Marks the main thread's phase at every hook (:class:`ProgressBoard`) for the :class:`HangWatcher` thread it
    starts at ``on_start`` (``distributed.hang_watchdog``) and stops at ``on_close``."""

    def __init__(self, section: DistributedConfig):
        self.section = section
        self.board = ProgressBoard()
        self.watcher: HangWatcher | None = None

    def attach(self, trainer) -> None:
        accelerator = trainer.run.accelerator
        self.rank, self.world_size = accelerator.process_index, accelerator.num_processes
        self.out_dir = trainer.out_dir

    def on_start(self, trainer) -> None:
        bound_group_timeouts(self.section.timeout_s)
        self.board.enter(trainer.state.step, START)
        if not self.section.hang_watchdog or self.world_size < 2:
            return
        store = launcher_store(_STORE_TIMEOUT_S)
        if store is None:
            logger.warning("hang watchdog off: MASTER_ADDR/MASTER_PORT are not set, so there is no store to publish in")
            return
        peer = this_peer(self.rank, self.world_size)
        self.watcher = HangWatcher(peer, self.board, Budgets.of(self.section), self.out_dir, store,
                                   prefix=store_prefix()).start()

    def before_step(self, trainer) -> None:
        self.board.enter(trainer.running_step, FORWARD_BACKWARD)

    def pre_optim_step(self, trainer) -> None:
        self.board.enter(trainer.running_step, OPTIMIZER)

    def after_step(self, trainer, result) -> None:
        self.board.enter(trainer.state.step, STEP_END)

    def on_step_end(self, trainer, result) -> None:
        self.board.record_step(trainer.state.step, trainer.step_time_s)

    def eval_figures(self, trainer, evaluate) -> dict[str, float]:
        self.board.enter(trainer.state.step, EVALUATION)
        return {}

    def after_eval(self, trainer, result: EvalResult) -> None:
        self.board.enter(trainer.state.step, EVALUATION)

    def on_save(self, trainer) -> None:
        step = trainer.state.step
        if trainer.checkpointer.due(step) or (trainer.stop is not None and trainer.stop.save):
            self.board.enter(step, CHECKPOINT)

    def on_end(self, trainer) -> None:
        self.board.enter(trainer.state.step, END)

    def on_error(self, trainer, err: BaseException) -> BaseException | None:
        if self.watcher is not None and self.watcher.acting.is_set():
            self.watcher.wait_for_exit()  # the collective broke because the watchdog killed a frozen peer
        self.board.enter(trainer.state.step, ERROR)
        return None

    def on_close(self, trainer) -> None:
        if self.watcher is not None:
            self.watcher.close()
