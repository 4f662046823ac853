"""The one checkpoint object the training loop uses: save when due, resume at the start, roll back during the run.

:class:`Checkpointer` puts together the parts, each in its module: when to save and what to keep (``saving.py``),
the ``train_state.json`` record and the extras (``record.py``), resume and rollback (``resume.py``); the files and
their atomic publication are the store's (``storage.py``). Every method is called on every rank.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterable

import torch

from lmrecipe.checkpoint.record import CheckpointState, LoopState, RunFacts, StateRecord
from lmrecipe.checkpoint.resume import Resumer
from lmrecipe.checkpoint.saving import Saver
from lmrecipe.config import CheckpointConfig
from lmrecipe.data.sources import TrainingData
from lmrecipe.parallel.topology import Topology


class Checkpointer:
    """A run's checkpoints in ``out_dir/checkpoints``: :meth:`due` and :meth:`maybe_save`, :meth:`maybe_resume`,
    :meth:`restore` (a rollback), :meth:`wait` for a background write; ``latest``, ``best()``, ``resumed_from`` and
    ``branched_from``."""

    def __init__(self, section: CheckpointConfig, facts: RunFacts, accelerator, out_dir: Path, *, topology: Topology,
                 data: TrainingData, lr_schedule: Callable[[int], float], extras: Iterable[CheckpointState] = (),
                 next_sample: Callable[[int], int] | None = None,
                 probe_kwargs: Callable[[torch.device], dict] | None = None):
        """
        Args:
            section: the ``checkpoint`` section (interval, retention, resume, background writes).
            facts: what the checkpoints need to know of the run besides (``record.RunFacts``).
            topology: the run's topology (recorded in each checkpoint, and compared on resume).
            data: the training data: its signature is recorded and compared on resume (for a mixture, its sources:
                a resume must keep names and quotas), the probe window and the tokenizer files come from it.
            lr_schedule: the learning rate of a step, recorded so a resume can say if it changes.
            extras: the trainer's callbacks with state, saved and restored by name (``record.CheckpointState``).
            next_sample: the global sample index the step after a given one reads (the data order's position,
                skipped batches included), recorded as ``data.next_sample``; None: ``step x samples_per_step``.
            probe_kwargs: the probe forward's further keyword arguments on a device (the document boundaries of
                ``data.document_masking``); None for none.
        """
        record = StateRecord(accelerator, facts, topology=topology, data=data, lr_schedule=lr_schedule, extras=extras,
                             next_sample=next_sample)
        self.saver = Saver(accelerator, section, facts, out_dir, record, deepspeed=topology.zero.deepspeed, data=data,
                           probe_kwargs=probe_kwargs)
        self.store = self.saver.store
        self.resumer = Resumer(accelerator, facts, record, resume=section.resume, root=self.store.root, data=data,
                               branch_from=section.branch_from)
        self.resumed_from: Path | None = None
        """The checkpoint this run resumed from (never overwritten by a save), or None."""

    @property
    def root(self) -> Path:
        return self.store.root

    @property
    def latest(self) -> Path | None:
        """The newest checkpoint this run published or resumed from."""
        return self.store.latest

    @property
    def branched_from(self) -> dict | None:
        """The checkpoint this run branched from (``{"checkpoint", "step", "out_dir"}``), or None."""
        return self.resumer.record.branched_from

    def best(self) -> Path | None:
        """The complete checkpoint with the lowest validation loss, or None."""
        return self.store.best()

    def wait(self) -> None:
        """Block until the checkpoint written in the background (if any) is published, on every rank."""
        self.store.wait()

    def due(self, step: int) -> bool:
        """Whether ``step`` is saved (every ``checkpoint.every_steps`` steps and the last); preemption saves any."""
        return self.saver.due(step)

    def maybe_save(self, model, state: LoopState, preempted: bool = False) -> Path | None:
        """Save when the interval, the last step or a preemption asks for it (``saving.py``); the saved folder or
        None."""
        return self.saver.maybe_save(model, state, preempted, keep=self.resumed_from)

    def maybe_resume(self, model, optimizer, state: LoopState) -> str | None:
        """Restore weights, optimizer, training state, every rank's RNG and the extras from the checkpoint
        ``checkpoint.resume`` names (converted first when saved on another layout; ``resume.py``); its path, or None.
        ``model`` and ``optimizer`` are also what a later :meth:`restore` reloads."""
        path = self.resumer.maybe_resume(model, optimizer, state)
        if path is None:
            return None
        self.resumed_from = self.store.latest = path
        return str(path)

    def restore(self, path: Path, state: LoopState) -> None:
        """Reload checkpoint ``path`` of this run in-process (a rollback): weights, optimizer, state, RNG, extras."""
        self.resumer.restore(path, state)
