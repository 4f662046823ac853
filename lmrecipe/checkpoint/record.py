"""What ``train_state.json`` records of a run at a step, and the trainer's callbacks' state saved beside it by name.

The record: the loop's core state (``state``), each extra's state by name (``extras``), the layout the optimizer
state was cut in (``topology``; a tensor-parallel run's splits too), the model's transformers config, the resolved
run config, the step's validation loss, the data position and signature, the schedule's learning rates and, for a
branch, the checkpoint it branched from (``branched_from``). The store adds the manifest and writes the file last
(``storage.py``).

Extras are the loop's features with state (:class:`CheckpointState`); every method of every extra is called.
A checkpoint written before extras existed passes its flat ``state`` to each ``load_state_dict``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Protocol

from lmrecipe.checkpoint.tp_split import RECORD_KEY as TP_RECORD
from lmrecipe.checkpoint.tp_split import splits_of
from lmrecipe.data.sources import TrainingData
from lmrecipe.parallel.accelerator import unwrap_model
from lmrecipe.parallel.topology import Topology


class CheckpointState(Protocol):
    """A trainer callback's own state, saved in every checkpoint under its ``name`` and restored on resume and rollback.

    ``state_dict`` is taken at the save step (main process) and written as ``extras.<name>`` of ``train_state.json``
    (an empty dict is not written); the other methods are called on every rank.
    """

    name: str

    def state_dict(self) -> dict:
        """JSON-serialisable state."""

    def load_state_dict(self, state: dict | None) -> None:
        """Take the saved state; None: the checkpoint holds none for this feature."""

    def save_files(self, folder: Path) -> None:
        """Write tensor files into the checkpoint folder being written."""

    def load_files(self, folder: Path) -> None:
        """Read them back from a checkpoint folder."""


class LoopState(Protocol):
    """The loop's core training state (``lmrecipe.train.state.TrainState``), as a checkpoint reads and restores it."""

    step: int
    tokens_seen: int
    last_val_loss: float | None
    last_val_step: int | None

    def state_dict(self) -> dict:
        """The fields as saved in ``train_state.json`` (``state``)."""

    def load_state_dict(self, saved: dict) -> None:
        """Take a checkpoint's ``state``."""


@dataclass(frozen=True)
class RunFacts:
    """What the checkpoints need to know of the run beyond the ``checkpoint`` section."""

    samples_per_step: int
    """Samples per optimizer step over all ranks (``train.global_batch_size``): the data position of a step."""
    max_steps: int
    """``train.max_steps``: the last step is always saved; a checkpoint past it has nothing left to train."""
    publish_timeout_s: float
    """How long a background write waits for the other ranks' files (``distributed.timeout_s``)."""
    run_config: dict
    """The resolved config (``Config.to_dict()``), saved with each checkpoint and compared on resume."""


class StateRecord:
    """The ``train_state.json`` record of this run, and the extras saved and restored by name.

    Every method is called on every rank.
    """

    def __init__(self, accelerator, facts: RunFacts, *, topology: Topology, data: TrainingData,
                 lr_schedule: Callable[[int], float], extras: Iterable[CheckpointState] = (),
                 next_sample: Callable[[int], int] | None = None):
        """
        Args:
            topology: the run's topology (recorded in each checkpoint, and compared on resume).
            data: the training data, whose signature is recorded (for a mixture, its sources).
            lr_schedule: the learning rate of a step, recorded so a resume can say if it changes.
            extras: the trainer's callbacks saved and restored by name.
            next_sample: the global sample index the step after a given one reads (the data order's position,
                skipped batches included), recorded as ``data.next_sample``; None: ``step x samples_per_step``.
        """
        self.accelerator = accelerator
        self.facts = facts
        self.topology = topology
        self.data = data
        self.lr_schedule = lr_schedule
        self.extras: dict[str, CheckpointState] = {}
        for extra in extras:
            if extra.name in self.extras:
                raise ValueError(f"two checkpoint extras are named {extra.name!r}")
            self.extras[extra.name] = extra
        self.next_sample = next_sample or (lambda step: step * facts.samples_per_step)
        self.branched_from: dict | None = None
        """Where this run branched from (``{"checkpoint", "step", "out_dir"}``), recorded in every checkpoint; set
        by the resume."""

    def tensor_parallel(self, model) -> tuple[dict, int] | None:
        """This run's AutoTP splits and this rank's tensor-parallel rank; None without tensor parallelism."""
        size = self.topology.tensor_parallel_size
        if size == 1:
            return None
        return splits_of(unwrap_model(self.accelerator, model)), self.accelerator.process_index % size

    def hf_config(self, model) -> dict:
        """The model's transformers config as ``hf/config.json`` holds it."""
        return json.loads(unwrap_model(self.accelerator, model).config.to_json_string())

    def build(self, state: LoopState, model) -> dict:
        """The record at ``state``, as JSON values (a copy: a background write publishes it later)."""
        record = {
            "state": state.state_dict(),
            "topology": self.topology.record(),
            **({TP_RECORD: splits_of(unwrap_model(self.accelerator, model))}
               if self.topology.tensor_parallel_size > 1 else {}),
            "hf_config": self.hf_config(model),
            "config": self.facts.run_config,
            # A feature that keeps only files (the weight EMA) has an empty state: nothing to write for it.
            "extras": {name: saved for name, extra in self.extras.items() if (saved := extra.state_dict())},
            "val_loss": state.last_val_loss if state.last_val_step == state.step else None,
            "data": {"next_sample": self.next_sample(state.step), **self.data.signature()},
            "schedule": {
                "last_lr": self.lr_schedule(state.step - 1) if state.step else None,
                "next_lr": self.lr_schedule(state.step),
            },
            **({"branched_from": self.branched_from} if self.branched_from else {}),
        }
        return json.loads(json.dumps(record))

    def save_files(self, folder: Path) -> None:
        """Every extra's files into the checkpoint folder being written."""
        for extra in self.extras.values():
            extra.save_files(folder)

    def restore_extras(self, checkpoint: Path, saved: dict) -> None:
        """Every extra's state (by name) and files from ``checkpoint``, whose ``train_state.json`` is ``saved``."""
        states = saved.get("extras")
        for name, extra in self.extras.items():
            extra.load_state_dict(saved["state"] if states is None else states.get(name))
            extra.load_files(checkpoint)
