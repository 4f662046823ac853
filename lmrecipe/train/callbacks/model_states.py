"""``logging.measure_model_states``: this rank's model-state bytes (weights, gradients, optimizer states), measured
from the tensors it holds (``lmrecipe.planning.memory.model_state_bytes``) and written to ``memory_rank{rank}.json`` in the
run folder, for ``tools/compare_zero.py`` to set beside the ZeRO estimate.

The sample is taken in the second optimizer step the process runs, the first that finds the optimizer states (the
first update creates them), at ``pre_optim_step``: every gradient of the step is complete and the update has not
consumed it.
"""

from __future__ import annotations

import logging
from pathlib import Path

from lmrecipe.fileio import write_json_atomic
from lmrecipe.planning.memory import format_bytes, model_state_bytes
from lmrecipe.train.callback import Callback

logger = logging.getLogger(__name__)

MEASURED_AT_UPDATE = 2
"""Which optimizer step of the process (1-based) is measured."""


class ModelStates(Callback):
    """Writes ``memory_rank{rank}.json`` once, in step :data:`MEASURED_AT_UPDATE` (every rank its own file)."""

    def __init__(self):
        self.steps_run = 0

    def attach(self, trainer) -> None:
        self.run = trainer.run
        accelerator = self.run.accelerator
        self.rank, self.world_size = accelerator.process_index, accelerator.num_processes
        self.path = Path(trainer.out_dir) / f"memory_rank{self.rank}.json"

    def after_step(self, trainer, result) -> None:
        self.steps_run += 1

    def pre_optim_step(self, trainer) -> None:
        if self.steps_run + 1 != MEASURED_AT_UPDATE:
            return
        sample = model_state_bytes(self.run.model, self.run.optimizer)
        write_json_atomic(self.path, {"rank": self.rank, "world_size": self.world_size,
                                      "measured_at_update": MEASURED_AT_UPDATE, **sample})
        logger.info("Model states on rank %d: %s", self.rank, format_bytes(sample["total"]))
