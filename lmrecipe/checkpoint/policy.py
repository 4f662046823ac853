"""The checkpoint policy of a run: when to save, what to keep, what a resume must match, and the run's resume.

The files and their atomic publication are described in ``lmrecipe/checkpoint/storage.py``.
"""

from __future__ import annotations

import errno
import json
import logging
import pickle
import shutil
import time
from dataclasses import fields
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from safetensors import SafetensorError

from lmrecipe.checkpoint.compat import check_resume_compatible
from lmrecipe.checkpoint.portable import (
    cached_portable,
    finish,
    load_portable,
    open_source,
    plan_shards,
    portable_dir,
    stale_form,
    state_sha256,
    write_share,
)
from lmrecipe.checkpoint.storage import (
    DS_TAG,
    HF_DIR,
    PREEMPTED_MARKER,
    PROBE_FILE,
    PROBE_TOKENS,
    RNG_DIR,
    STATE_FILE,
    CheckpointStore,
    find_resume_checkpoint,
    read_checkpoint,
    rng_state_tensors,
    set_rng_state,
    step_dir_name,
    use_earlier,
)
from lmrecipe.checkpoint.tp_split import RECORD_KEY as TP_RECORD
from lmrecipe.checkpoint.tp_split import splits_of
from lmrecipe.config import Config, due_at
from lmrecipe.data.sources import TrainingData
from lmrecipe.distributed import Layout, ZeroSetup
from lmrecipe.errors import UserError, fail
from lmrecipe.fileio import install_dir, remove_path, temp_dir_for, write_text_atomic
from lmrecipe.optim import optimizer_param_names

logger = logging.getLogger(__name__)

# --------------------------------------------------------------------------------------------------


def continue_sample_order(batches, saved: dict) -> None:
    """A checkpoint written with an earlier sample order (no ``order_version``: version 1) continues in it."""
    version = int(saved.get("data", {}).get("order_version", 1))
    if version != batches.order_version:
        logger.info("The checkpoint was written with sample order version %d; this run continues in it (new runs use "
                    "version %d, constant in memory).", version, batches.order_version)
        batches.use_order_version(version)


class CheckpointExtra:
    """What a loop feature hands the checkpoint, by name (``Checkpointer(extras={name: feature})``); every method is
    optional.

    ``state_dict() -> dict``: JSON-serialisable state, taken at the save step (main process) and written under
    ``extras.<name>`` of ``train_state.json``. ``load_state_dict(state: dict | None)``: restore it on every rank
    (None: the checkpoint holds nothing for this feature; a checkpoint written before extras existed passes its
    flat ``state``). ``save_files(folder)`` / ``load_files(folder)``: tensor files in the checkpoint folder, called
    on every rank (the weight EMA).
    """


class Checkpointer:
    """The checkpoint policy of a run: when to save and what goes in (the probe, ``hf/``, the extras, the training
    state), what a resume must match (``compat.py``), resuming and rolling back; the files are the store's
    (:class:`~lmrecipe.checkpoint.storage.CheckpointStore`).

    Every method is called on every rank; collectives (DeepSpeed's save, the probe forward) run on all of
    them and only the main process writes shared files.
    """

    def __init__(self, cfg: Config, accelerator, out_dir: Path, *, zero: ZeroSetup, data: TrainingData,
                 lr_schedule: Callable[[int], float], extras: Mapping[str, Any] | None = None,
                 next_sample: Callable[[int], int] | None = None,
                 probe_kwargs: Callable[[torch.device], dict] | None = None):
        """
        Args:
            cfg: the run's configuration: its ``checkpoint`` section (interval, retention, resume); the global batch
                size (the data position of a step is ``step x train.global_batch_size``); ``train.max_steps``, which is
                always saved; ``distributed.timeout_s``, how long a background write waits for the other ranks'
                files. The whole of it is saved with each checkpoint and compared on resume.
            zero: the run's DeepSpeed setup (recorded, and compared on resume).
            data: the training data: its signature is recorded and compared on resume (for a mixture, its sources:
                a resume must keep names and quotas), the probe window and the tokenizer files come from it.
            lr_schedule: the learning rate of a step, recorded so a resume can say if it changes.
            extras: the loop features' own state, saved and restored by name (see :class:`CheckpointExtra`).
            next_sample: the global sample index the step after a given one reads (the data order's position,
                skipped batches included), recorded as ``data.next_sample``; None: ``step x samples_per_step``.
            probe_kwargs: the probe forward's further keyword arguments on a device (the document boundaries of
                ``data.document_masking``); None for none.
        """
        section = cfg.checkpoint
        samples_per_step = cfg.train.global_batch_size
        self.section = section
        self.accelerator = accelerator
        self.out_dir = out_dir
        self.zero = zero
        self.data = data
        self.samples_per_step = samples_per_step
        self.max_steps = cfg.train.max_steps
        self.sequence_parallel_size = cfg.distributed.sequence_parallel_size
        self.tensor_parallel_size = cfg.distributed.tensor_parallel_size
        self.run_config = cfg.to_dict()
        self.lr_schedule = lr_schedule
        self.extras = dict(extras or {})
        self.next_sample = next_sample or (lambda step: step * samples_per_step)
        self.probe_ids = data.probe_ids(PROBE_TOKENS)
        self.probe_kwargs = probe_kwargs
        self.resumed_from: Path | None = None
        self.model = self.optimizer = None
        self.store = CheckpointStore(accelerator, out_dir / "checkpoints", keep_last=section.keep_last,
                                     background=section.background_save, deepspeed=zero.deepspeed,
                                     publish_timeout_s=cfg.distributed.timeout_s)
        if accelerator.is_main_process:
            (out_dir / PREEMPTED_MARKER).unlink(missing_ok=True)
        accelerator.wait_for_everyone()

    @property
    def root(self) -> Path:
        return self.store.root

    @property
    def latest(self) -> Path | None:
        """The newest checkpoint this run published or resumed from."""
        return self.store.latest

    def wait(self) -> None:
        """Block until the checkpoint written in the background (if any) is published, on every rank."""
        self.store.wait()

    def best(self) -> Path | None:
        return self.store.best()

    # ---- resume

    def maybe_resume(self, model, optimizer, state) -> str | None:
        """Restore weights, optimizer, training state and every rank's RNG from the chosen checkpoint.

        A checkpoint saved on another layout (process count under DeepSpeed, ZeRO stage, offload, DeepSpeed or
        not) is converted to its topology-free form first (``portable.py``); the log says what changed. ``model``
        and ``optimizer`` are also what a later :meth:`restore` (a rollback) reloads.
        """
        self.model, self.optimizer = model, optimizer
        path = find_resume_checkpoint(self.section.resume, self.root)
        if path is None:
            return None
        saved = read_checkpoint(path)
        if saved["state"]["step"] > self.max_steps:  # the loop would not run, and the end of the run would re-export
            raise fail(f"{path} is at step {saved['state']['step']}, past train.max_steps={self.max_steps}: there is "
                       "nothing to train. Raise train.max_steps to train on, pass checkpoint.resume=PATH of an earlier "
                       "checkpoint, or export this one with tools/export_hf.py.")
        check_resume_compatible(saved, path, run_config=self.run_config,
                                hf_config=self.accelerator.unwrap_model(model).config.to_dict(),
                                data_signature=self._data_signature(), lr_schedule=self.lr_schedule)
        continue_sample_order(self.data.train_batches, saved)
        self._load(path, saved, model, optimizer, state)
        self.resumed_from = self.store.latest = path
        changes = self.layout().changes_from(Layout.from_topology(saved["topology"]))
        if changes:
            logger.info("Resumed from %s at step %d (%d tokens seen) on a new layout: %s. Weights, AdamW moments and "
                        "step counts were loaded by parameter name; the data continues at sample %d.", path, state.step,
                        state.tokens_seen, "; ".join(changes), saved["data"]["next_sample"])
        else:
            logger.info("Resumed from %s at step %d (%d tokens seen)", path, state.step, state.tokens_seen)
        return str(path)

    def layout(self) -> Layout:
        """How this run cuts its optimizer state (recorded in each checkpoint's ``topology``)."""
        return Layout.of_run(self.accelerator.num_processes, self.zero, self.sequence_parallel_size,
                             self.tensor_parallel_size)

    def _tensor_parallel(self, model) -> tuple[dict, int] | None:
        """This run's AutoTP splits and this rank's tensor-parallel rank; None without tensor parallelism."""
        if self.tensor_parallel_size == 1:
            return None
        return splits_of(self.accelerator.unwrap_model(model)), self.accelerator.process_index % self.tensor_parallel_size

    def _portable_form(self, path: Path, saved: dict, model) -> Path:
        """The checkpoint's topology-free form, cached beside it (``step_XXXXXXXX.portable``; the checkpoint itself
        is not modified): reused when cached, else converted once, every rank writing its share of the parameters.

        A checkpoint in a folder that cannot be written to (read-only storage) gets its cache in this run's
        ``checkpoints/`` instead.
        """
        from accelerate.utils import broadcast_object_list

        digest = state_sha256(path, STATE_FILE)
        outcome = [None, None, None]  # (folder, the temporary folder to fill or None when cached, error)
        if self.accelerator.is_main_process:
            outcome = self._portable_target(path, digest)
        broadcast_object_list(outcome)
        folder, building, error = outcome
        if error is not None:
            raise fail(error)
        if building is not None:
            self._convert(path, saved, model, Path(building), Path(folder), digest)
        return Path(folder)

    def _portable_target(self, path: Path, digest: str) -> list:
        """Main process: [cache folder, temporary folder to build it in (None: cached), error]."""
        error = None
        for dest in dict.fromkeys((portable_dir(path), portable_dir(path, self.root))):
            if cached_portable(dest, digest):
                logger.info("Using the topology-free form of %s cached in %s", path, dest)
                return [str(dest), None, None]
            if stale_form(dest):
                logger.info("%s holds the topology-free form of earlier code (format 1); converting %s again", dest, path)
            try:
                return [str(dest), str(temp_dir_for(dest)), None]
            except OSError as err:  # read-only checkpoint storage: try the run's own folder
                if err.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
                    raise
                error = f"Cannot write the topology-free form of {path} to {dest}: {err}."
        return [None, None, error]

    def _convert(self, path: Path, saved: dict, model, tmp: Path, dest: Path, digest: str) -> None:
        """Every rank writes its files of the topology-free form into ``tmp``; then the main process writes the
        indexes and renames ``tmp`` to ``dest``. A failure on any rank stops every rank with its message."""
        from accelerate.utils import gather_object

        acc = self.accelerator
        start = time.perf_counter()
        saved_layout = Layout.from_topology(saved["topology"])
        names = optimizer_param_names(acc.unwrap_model(model), bool(saved["config"]["optim"].get("decay_embeddings")))
        source = plan = error = None
        try:
            source = open_source(path, deepspeed_dir=path / DS_TAG if saved_layout.deepspeed else None, param_names=names,
                                 tensor_parallel=(saved_layout.tensor_parallel_size, saved.get(TP_RECORD, {})))
            plan = plan_shards(source.shapes, acc.num_processes)
            write_share(source, plan, tmp, acc.process_index, progress=acc.is_main_process)
        except UserError as err:
            error = str(err)
        except (OSError, RuntimeError, ValueError, EOFError, pickle.UnpicklingError) as err:
            error = (f"Converting checkpoint {path} to its topology-free form failed: {type(err).__name__}: "
                     f"{str(err)[:300]}. A file of it is damaged, or was written by different code, or {tmp.parent} "
                     f"is full. {use_earlier(path)}")
        errors = [e for e in gather_object([error]) if e is not None]
        try:
            if not errors and acc.is_main_process:
                finish(tmp, plan, source.steps, source_layout=saved_layout, source_sha256=digest)
                install_dir(tmp, dest, overwrite=True)
                logger.info("Converted %s to its topology-free form %s on %d processes (%d parameters, %.1f MB, %.1f s)",
                            path, dest, acc.num_processes, len(plan.shapes),
                            sum(f.stat().st_size for f in dest.iterdir()) / 1e6, time.perf_counter() - start)
        finally:
            if source is not None:
                source.close()
            if errors and acc.is_main_process:
                remove_path(tmp)
        if errors:
            raise fail(errors[0])
        acc.wait_for_everyone()

    def _data_signature(self) -> dict:
        return self.data.signature()

    def _restore_rng(self, path: Path, saved_world_size: int) -> None:
        """Each rank's RNG streams as saved. Ranks beyond the saving run's count keep fresh streams: RNG state is
        per rank and cannot be split or merged. The default model draws no random numbers while training (no
        dropout; the sample order is a function of the step), so losses do not depend on it."""
        from safetensors import safe_open

        rank = self.accelerator.process_index
        rng_file = path / RNG_DIR / f"rank_{rank:05d}.safetensors"
        if rank >= saved_world_size or not rng_file.is_file():
            logger.info("%s holds no RNG state for rank %d (saved with %d processes); it starts fresh streams "
                        "(seeded by train.seed).", path, rank, saved_world_size)
            return
        with safe_open(rng_file, framework="pt") as fh:
            set_rng_state({k: fh.get_tensor(k) for k in fh.keys()}, fh.metadata())

    def restore(self, path: Path, state) -> None:
        """Reload a checkpoint of this run in-process (a rollback): weights, optimizer, training state, RNG.

        The same loading as a resume, without the compatibility check (the checkpoint is this run's, or the one it
        resumed from, possibly on another layout).
        """
        self._load(path, read_checkpoint(path), self.model, self.optimizer, state)
        logger.info("Reloaded %s (step %d)", path, state.step)

    def _load(self, path: Path, saved: dict, model, optimizer, state) -> None:
        """Weights, optimizer, training state, every rank's RNG and the extra state, from checkpoint ``path``."""
        saved_layout = Layout.from_topology(saved["topology"])
        optimizer_name = saved["config"]["optim"].get("name", "adamw")  # checkpoints from before optim.name: AdamW
        if optimizer_name != self.run_config["optim"]["name"]:
            raise fail(f"{path} holds {optimizer_name} optimizer state; this run trains with optim.name="
                       f"{self.run_config['optim']['name']}. Resume with optim.name={optimizer_name}, or start a new run "
                       f"from its weights: python tools/export_hf.py {path} EXPORT --dtype fp32, then "
                       "model.init_from=EXPORT checkpoint.resume=none.")
        if optimizer_name != "adamw" and self.layout().needs_conversion_from(saved_layout):
            # The topology-free form holds AdamW's moments only.
            raise fail(f"{path} holds {optimizer_name} optimizer state saved on another layout "
                       f"({'; '.join(self.layout().changes_from(saved_layout))}), which cannot be converted. Resume "
                       "on the checkpoint's layout, or start a new run from its weights: python tools/export_hf.py "
                       f"{path} EXPORT --dtype fp32, then model.init_from=EXPORT checkpoint.resume=none.")
        try:
            if self.layout().needs_conversion_from(saved_layout):
                folder = self._portable_form(path, saved, model)
                load_portable(folder, model, optimizer, deepspeed=self.zero.deepspeed, step=saved["state"]["step"],
                              samples_per_step=self.samples_per_step, tensor_parallel=self._tensor_parallel(model))
            else:
                # load_kwargs: the non-DeepSpeed optimizer and RNG pickles are read with the tensors-only unpickler.
                self.accelerator.load_state(str(path), load_kwargs={"weights_only": True})
        except (RuntimeError, ValueError, EOFError, pickle.UnpicklingError, SafetensorError) as err:
            # The manifest checked names, sizes and safetensors headers; a file damaged inside fails only here.
            raise fail(f"Loading checkpoint {path} failed: {type(err).__name__}: {str(err)[:300]}. A file of it is "
                       f"damaged, or was written by different code. {use_earlier(path)}") from None
        names = {f.name for f in fields(state)}
        for key, value in saved["state"].items():
            if key in names:
                setattr(state, key, value)
        self._restore_rng(path, saved_layout.world_size)
        self._load_extras(path, saved)

    def _load_extras(self, path: Path, saved: dict) -> None:
        """Each extra's state by name; a checkpoint written before extras existed holds theirs in ``state``."""
        states = saved.get("extras")
        for name, extra in self.extras.items():
            if hasattr(extra, "load_state_dict"):
                extra.load_state_dict(saved["state"] if states is None else states.get(name))
            if hasattr(extra, "load_files"):
                extra.load_files(path)

    # ---- save

    def due(self, step: int) -> bool:
        """Whether ``step`` is saved (every ``checkpoint.every_steps`` steps and the last); preemption saves any."""
        return due_at(step, self.section.every_steps, self.max_steps)

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

    def maybe_save(self, model, state, preempted: bool = False) -> Path | None:
        """Save when the interval, the last step or a preemption asks for it; publish atomically; prune.

        With ``checkpoint.background_save`` the files are written on a thread and published when every rank's
        are done; a preemption and the last step wait for that before returning.
        """
        from safetensors.torch import save_file

        if not (preempted or self.due(state.step)):
            return None
        self.wait()  # one write in flight at most
        acc = self.accelerator
        final = self.root / step_dir_name(state.step)
        if final == self.resumed_from:
            raise RuntimeError(f"refusing to overwrite {final}, the checkpoint this run resumed from")
        tmp = self.store.begin(final)
        probe = self._probe_logits(model)
        try:
            # The small files, in the loop also with background writes: this rank's RNG state, the probe and hf/
            # (main process), the extras' files (the weight EMA: see train/ema.py for its size).
            tensors, metadata = rng_state_tensors()
            save_file(tensors, tmp / RNG_DIR / f"rank_{acc.process_index:05d}.safetensors", metadata=metadata)
            if acc.is_main_process:
                save_file({"input_ids": self.probe_ids.contiguous(), "logits": probe.contiguous()}, tmp / PROBE_FILE)
                self._write_hf_dir(model, tmp / HF_DIR)
            for extra in self.extras.values():
                if hasattr(extra, "save_files"):
                    extra.save_files(tmp)
            # The JSON part of train_state.json as of this step (a background publication comes later).
            record = json.loads(json.dumps(self._state_record(state, model)))
            self.store.write(model, tmp, final, record)
        except (OSError, RuntimeError) as err:
            full = self.store.disk_full_error(err, tmp, final)
            if full is None:
                raise
            raise full from None
        if self.store.background and not (preempted or state.step >= self.max_steps):
            return final
        self.wait()
        if acc.is_main_process and preempted:
            marker = {"step": state.step, "checkpoint": str(final)}
            write_text_atomic(self.out_dir / PREEMPTED_MARKER, json.dumps(marker) + "\n", durable=True)
        acc.wait_for_everyone()
        self.store.latest = final
        return final



    def _write_hf_dir(self, model, hf_dir: Path) -> None:
        hf_dir.mkdir()
        self.accelerator.unwrap_model(model).config.to_json_file(hf_dir / "config.json")
        for file in self.data.tokenizer_files():
            shutil.copy2(file, hf_dir / file.name)

    def _state_record(self, state, model) -> dict:
        """What ``train_state.json`` says of the run at ``state``: the training state, each extra's state, the
        validation loss of this step, the data position and the schedule's values."""
        return {
            "state": {f.name: getattr(state, f.name) for f in fields(state)},
            "topology": self.layout().to_dict(),
            **({TP_RECORD: splits_of(self.accelerator.unwrap_model(model))} if self.tensor_parallel_size > 1 else {}),
            "hf_config": self._hf_config(model),
            "config": self.run_config,
            "extras": {name: extra.state_dict() for name, extra in self.extras.items() if hasattr(extra, "state_dict")},
            "val_loss": state.last_val_loss if state.last_val_step == state.step else None,
            "data": {"next_sample": self.next_sample(state.step), **self._data_signature()},
            "schedule": {
                "last_lr": self.lr_schedule(state.step - 1) if state.step else None,
                "next_lr": self.lr_schedule(state.step),
            },
        }

    def _hf_config(self, model) -> dict:
        """The model's transformers config as ``hf/config.json`` holds it."""
        return json.loads(self.accelerator.unwrap_model(model).config.to_json_string())
