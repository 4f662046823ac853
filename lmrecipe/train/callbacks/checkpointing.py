"""When the loop touches checkpoints: resume at the start, save at each save point, export at the end.

The files, their publication and their reading are ``lmrecipe/checkpoint/``'s; these callbacks decide when.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Callable, Mapping

import numpy as np

from lmrecipe.checkpoint.checkpointer import Checkpointer
from lmrecipe.checkpoint.record import RunFacts
from lmrecipe.checkpoint.storage import PROBE_TOKENS
from lmrecipe.config import CheckpointConfig
from lmrecipe.train.callback import Callback
from lmrecipe.train.setup import Run

logger = logging.getLogger(__name__)


def build_checkpointer(run: Run, out_dir: Path, extras: Mapping[str, Callback] | None = None,
                       next_sample: Callable[[int], int] | None = None) -> Checkpointer:
    """The run's checkpointer; ``extras``: the stateful callbacks by name; ``next_sample``: the data position of a
    step (None: ``step x train.global_batch_size``)."""
    cfg = run.cfg
    facts = RunFacts(samples_per_step=cfg.train.global_batch_size, max_steps=cfg.train.max_steps,
                     publish_timeout_s=cfg.distributed.timeout_s, run_config=cfg.to_dict())
    return Checkpointer(cfg.checkpoint, facts, run.accelerator, out_dir, topology=run.runtime.topology, data=run.data,
                        lr_schedule=run.lr_at, extras=(extras or {}).values(), next_sample=next_sample,
                        probe_kwargs=probe_kwargs(run))


def probe_kwargs(run: Run):
    """The document keywords of the checkpoints' probe forward (the first tokens of the first validation window)."""
    if run.attention is None:
        return None
    windows = next(iter(run.data.val_sets.values())).windows
    documents = windows.documents_at(np.zeros(1, dtype=np.int64), PROBE_TOKENS).as_tensors()
    return functools.partial(run.attention.forward_kwargs, documents)


class Checkpointing(Callback):
    """Resumes as ``checkpoint.resume`` says (before every other callback starts), saves every
    ``checkpoint.every_steps`` steps, at the last step and when a stop asks for it (a preemption), and waits for
    a background write at the end."""

    follows = ("RemoteResume", "Preemption", "Watchdog")  # a newer remote checkpoint is downloaded before the resume;
    # a preemption's stop is asked for before the save point's checkpoint; a save is timed against its own budget

    def on_start(self, trainer) -> None:
        run = trainer.run
        # Restores the stateful callbacks too: the checkpointer holds them by name.
        trainer.resumed_from = trainer.checkpointer.maybe_resume(run.model, run.optimizer, trainer.state)

    def needs_sync(self, trainer, step: int) -> bool:
        return trainer.checkpointer.due(step)

    def on_save(self, trainer) -> None:
        forced = trainer.stop is not None and trainer.stop.save
        trainer.checkpointer.maybe_save(trainer.run.model, trainer.state, preempted=forced)

    def on_end(self, trainer) -> None:
        trainer.checkpointer.wait()  # a background write in flight (early stopping)


class ExportAtEnd(Callback):
    """``checkpoint.export_at_end``: the Hugging Face export of the last checkpoint (with early stopping on, the best
    by validation loss) into ``out_dir/export`` (main process; the others need not wait)."""

    follows = ("Checkpointing",)  # the last checkpoint is written before it is exported

    def __init__(self, section: CheckpointConfig):
        self.section = section
        self.source: Path | None = None
        self.export: Path | None = None

    def attach(self, trainer) -> None:
        self.accelerator = trainer.run.accelerator
        self.out_dir = trainer.out_dir
        self.early_stopping = trainer.run.cfg.train.early_stopping_patience > 0

    def on_end(self, trainer) -> None:
        checkpointer = trainer.checkpointer
        best = checkpointer.best() if self.early_stopping else None
        self.source = best if best is not None else checkpointer.latest
        if not self.section.export_at_end or self.source is None or not self.accelerator.is_main_process:
            return
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        from lmrecipe.export import export_checkpoint

        # Training is over: detach transformers from the live ZeRO-3 config, or building the export's model would
        # enter zero.Init and wait for the other ranks, which have left.
        unset_hf_deepspeed_config()
        section = self.section
        self.export = export_checkpoint(self.source, self.out_dir / "export", dtype=section.export_dtype,
                                        max_shard_size=section.max_shard_size, overwrite=True,
                                        weights=section.export_weights)
        logger.info("Exported %s from %s", self.export, self.source)

    def outcome(self, trainer) -> dict:
        return {"export": str(self.export) if self.export else None,
                "export_from": str(self.source) if self.source else None,
                "export_weights": self.section.export_weights if self.export else None}
