"""When a run saves a checkpoint, what goes in it, and which checkpoints are kept.

Due: every ``checkpoint.every_steps`` steps and the last (``train.max_steps``); a preemption saves any step. A
save writes, on every rank, the rank's RNG streams (``rng.py``), the probe logits and ``hf/`` (main process), the
extras' files and the record (``record.py``); the store then writes Accelerate's state and publishes the folder
atomically, now or on a worker thread (``checkpoint.background_save``), and keeps the ``checkpoint.keep_last``
newest and the best by validation loss (``storage.py``). A preempted run leaves ``out_dir/preempted.json``, which
the next run removes when it starts.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import torch
from safetensors import SafetensorError

from lmrecipe.checkpoint.record import LoopState, RunFacts, StateRecord
from lmrecipe.checkpoint.rng import save_rng
from lmrecipe.checkpoint.storage import (
    HF_DIR,
    PREEMPTED_MARKER,
    PROBE_FILE,
    PROBE_TOKENS,
    CheckpointStore,
    step_dir_name,
)
from lmrecipe.config import CheckpointConfig, due_at
from lmrecipe.data.sources import TrainingData
from lmrecipe.fileio import write_text_atomic
from lmrecipe.parallel.accelerator import unwrap_model


class Saver:
    """Saves the run's checkpoints into ``out_dir/checkpoints`` (its store). Every method is called on every rank:
    collectives (DeepSpeed's save, the probe forward) run on all of them, and only the main process writes shared
    files."""

    def __init__(self, accelerator, section: CheckpointConfig, facts: RunFacts, out_dir: Path, record: StateRecord, *,
                 deepspeed: bool, data: TrainingData, probe_kwargs: Callable[[torch.device], dict] | None = None):
        """
        Args:
            deepspeed: the run trains under DeepSpeed (how the store copies the state for a background write).
            data: where the probe window and the tokenizer files of ``hf/`` come from.
            probe_kwargs: the probe forward's further keyword arguments on a device (the document boundaries of
                ``data.document_masking``); None for none.
        """
        self.accelerator = accelerator
        self.section = section
        self.max_steps = facts.max_steps
        self.out_dir = out_dir
        self.record = record
        self.data = data
        self.probe_ids = data.probe_ids(PROBE_TOKENS)
        self.probe_kwargs = probe_kwargs
        self.store = CheckpointStore(accelerator, out_dir / "checkpoints", keep_last=section.keep_last,
                                     background=section.background_save, deepspeed=deepspeed,
                                     publish_timeout_s=facts.publish_timeout_s)
        if accelerator.is_main_process:
            (out_dir / PREEMPTED_MARKER).unlink(missing_ok=True)
        accelerator.wait_for_everyone()

    def due(self, step: int) -> bool:
        """Whether ``step`` is saved (every ``checkpoint.every_steps`` steps and the last); preemption saves any."""
        return due_at(step, self.section.every_steps, self.max_steps)

    def maybe_save(self, model, state: LoopState, preempted: bool = False, keep: Path | None = None) -> Path | None:
        """Save when the interval, the last step or a preemption asks for it; publish atomically; prune.

        With ``checkpoint.background_save`` the files are written on a thread and published when every rank's are
        done; a preemption and the last step wait for that before returning. ``keep``: a checkpoint this save must
        not replace (the one the run resumed from).
        """
        if not (preempted or self.due(state.step)):
            return None
        self.store.wait()  # one write in flight at most
        final = self.store.root / step_dir_name(state.step)
        if final == keep:
            raise RuntimeError(f"refusing to overwrite {final}, the checkpoint this run resumed from")
        tmp = self.store.begin(final)
        probe = self._probe_logits(model)
        try:
            self._write_small_files(model, tmp, probe)
            self.store.write(model, tmp, final, self.record.build(state, model))
        except (OSError, RuntimeError, SafetensorError) as err:  # safetensors' writer raises its own error
            full = self.store.disk_full_error(err, tmp, final)
            if full is None:
                raise
            raise full from None
        if self.store.background and not (preempted or state.step >= self.max_steps):
            return final
        self.store.wait()
        if self.accelerator.is_main_process and preempted:
            marker = {"step": state.step, "checkpoint": str(final)}
            write_text_atomic(self.out_dir / PREEMPTED_MARKER, json.dumps(marker) + "\n", durable=True)
        self.accelerator.wait_for_everyone()
        self.store.latest = final
        return final

    def _write_small_files(self, model, tmp: Path, probe: torch.Tensor) -> None:
        """What is written in the loop also with background writes: this rank's RNG state, the probe and ``hf/``
        (main process), the extras' files (the weight EMA: see its module for the size)."""
        from safetensors.torch import save_file

        save_rng(tmp, self.accelerator.process_index)
        if self.accelerator.is_main_process:
            save_file({"input_ids": self.probe_ids.contiguous(), "logits": probe.contiguous()}, tmp / PROBE_FILE)
            self._write_hf_dir(model, tmp / HF_DIR)
        self.record.save_files(tmp)

    @torch.no_grad()
    def _probe_logits(self, model) -> torch.Tensor:
        # Every rank runs the forward: ZeRO-3 gathers parameters collectively.
        was_training = model.training
        model.eval()
        device = self.accelerator.device
        kwargs = self.probe_kwargs(device) if self.probe_kwargs is not None else {}
        logits = model(input_ids=self.probe_ids.to(device), **kwargs).logits.float().cpu()
        model.train(was_training)
        return logits

    def _write_hf_dir(self, model, hf_dir: Path) -> None:
        hf_dir.mkdir()
        unwrap_model(self.accelerator, model).config.to_json_file(hf_dir / "config.json")
        for file in self.data.tokenizer_files():
            shutil.copy2(file, hf_dir / file.name)
