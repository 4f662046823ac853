"""Resumable checkpoints: atomic saves, exact resume, retention, and the marker a preempted run leaves.

Layout of ``out_dir/checkpoints/``::

    step_00000100/              one complete checkpoint (see below)
    latest                      name of the newest complete checkpoint; replaced atomically, written last
    best                        name of the checkpoint with the lowest validation loss; never pruned

A checkpoint folder holds what ``accelerator.save_state`` writes (DeepSpeed's per-rank ZeRO shards under
``pytorch_model/``, or ``model.safetensors`` + ``optimizer.bin`` without DeepSpeed) and:

- ``rng/rank_NNNNN.safetensors``: the torch (CPU and CUDA), numpy and ``random`` RNG state of every rank;
- ``hf/``: the transformers ``config.json``, the tokenizer files and the data's ``meta.json``, so an export
  or an evaluation needs neither the recipe's data folder nor ``model.init_from``;
- ``probe.safetensors``: logits of the training-time model on a fixed input, to check exports against;
- with ``train.ema_decay`` > 0, the weight EMA (``ema.safetensors``, or ``ema/rank_NNNNN.safetensors`` under
  ZeRO-3; see ``lmrecipe/ema.py``), written by the ``extra_state`` the trainer passes in;
- ``train_state.json``: step, tokens seen, data position, best validation loss, the schedule's values, the
  resolved config, the topology and a manifest of every file with its size. Written last.

Atomicity: every rank writes into ``.tmp_step_N``; after a barrier the main process writes
``train_state.json`` and renames the folder to ``step_N``, then replaces ``latest``. A crash or ``kill -9``
at any moment leaves the previous checkpoint and the pointer intact; leftovers are removed at the next start.
The checkpoint folder must be on a filesystem every rank sees (a shared filesystem on multi-node jobs).

Background writes (``checkpoint.background_save``): at the step, every rank copies its state to CPU memory
(``lmrecipe/background_save.py``; under DeepSpeed, after the collective part of its save) and returns to training; a worker thread writes the copy into
``.tmp_step_N`` and then a marker ``.rank_NNNNN.done``. The main process's worker waits for every rank's marker
(the barrier of a synchronous save, without stopping the loop), removes the markers and publishes as above. So
the order of the commit (files, ``train_state.json`` last, rename, ``latest``) is the same, and a ``kill -9``
during a background write leaves the previous checkpoint complete. One write is in flight at most: the next
save, a rollback, a preemption and the end of the run wait for it (:meth:`Checkpointer.wait`).

Safe loading: our own state is JSON and safetensors. Without DeepSpeed, Accelerate reads ``optimizer.bin``
(and its own ``random_states_*.pkl``, which we then override) with ``torch.load(weights_only=True)``, which
reconstructs tensors and plain containers only. DeepSpeed's ZeRO shards are read by DeepSpeed's own loader,
which unpickles; that is the one full-pickle load left, and the shards are checked against the manifest first.
"""

from __future__ import annotations

import errno
import functools
import json
import logging
import math
import os
import random
import re
import shutil
import threading
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from .background_save import (
    BackgroundWriter, deepspeed_writes_captured, snapshot_accelerator_state, write_accelerator_state, write_captured,
)
from .config import CheckpointConfig, fixed_on_resume_keys, flatten_config
from .data import TokenWindows, data_step, file_sha256
from .distributed import ZeroSetup
from .errors import UserError, fail
from .fileio import fsync_dir, write_text_atomic
from .optim import optimizer_param_names
from .portable import (
    cached_portable, convert, layout_changes, layout_of, load_portable, needs_conversion, portable_dir, state_sha256,
)

logger = logging.getLogger(__name__)

#: Exit code of every training process after a SIGTERM/SIGUSR1 stop with a checkpoint saved; a requeued job
#: resumes with the default ``checkpoint.resume=auto``. Launchers (torchrun, accelerate launch) report any
#: failed worker as exit 1 (slurm/launch.sh restores 124), so the main process also writes
#: ``out_dir/preempted.json`` ({"step", "checkpoint"}); the next run removes it when it starts.
EXIT_PREEMPTED = 124
PREEMPTED_MARKER = "preempted.json"

FORMAT_VERSION = 1
STATE_FILE = "train_state.json"
HF_DIR = "hf"
RNG_DIR = "rng"
PROBE_FILE = "probe.safetensors"
DS_TAG = "pytorch_model"
"""Folder (DeepSpeed tag) that ``accelerator.save_state`` gives the first model's ZeRO shards."""
PROBE_TOKENS = 16
LATEST = "latest"
BEST = "best"
_STEP_DIR = re.compile(r"^step_(\d{8,})$")
_TMP_PREFIX = ".tmp_"
_PORTABLE_LEFTOVER = re.compile(r"^step_\d{8,}\.portable\.(tmp|old)-\d+$")
"""A topology-free form being built (``fileio.building_dir``) or replaced when a conversion was interrupted."""
_TRASH_PREFIX = ".trash_"
_DONE = ".rank_{:05d}.done"
_FAILED = ".rank_{:05d}.failed"

# Shape-defining fields of the transformers config, compared too (catches a changed model.init_from).
_HF_SHAPE_KEYS = (
    "model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "intermediate_size", "max_position_embeddings", "tie_word_embeddings",
)


# --------------------------------------------------------------------------------------------------
# Reading checkpoints (also used by export and eval, without an Accelerator)


@dataclass(frozen=True)
class SavedCheckpoint:
    step: int
    path: Path
    val_loss: float | None


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def complete_checkpoints(root: Path) -> list[SavedCheckpoint]:
    """Published checkpoints under ``root``, oldest first (folders still being written are not listed)."""
    found = []
    if not root.is_dir():
        return found
    for path in root.iterdir():
        match = _STEP_DIR.match(path.name)
        if match and (path / STATE_FILE).is_file():
            try:
                val_loss = json.loads((path / STATE_FILE).read_text()).get("val_loss")
            except (OSError, json.JSONDecodeError):
                val_loss = None
            found.append(SavedCheckpoint(int(match.group(1)), path, val_loss))
    return sorted(found, key=lambda c: c.step)


def looks_like_checkpoint(path: Path) -> bool:
    """A training checkpoint folder (complete or not), as opposed to a Hugging Face export."""
    markers = (STATE_FILE, DS_TAG, RNG_DIR, "optimizer.bin")
    return any((path / m).exists() for m in markers) or any(path.glob("random_states_*.pkl"))


def read_checkpoint(path: str | Path) -> dict:
    """Load ``train_state.json`` after checking that every file of the manifest is present and complete."""
    path = Path(path)
    if not path.is_dir():
        raise fail(f"Checkpoint {str(path)!r} does not exist or is not a folder.")
    state_file = path / STATE_FILE
    if not state_file.is_file():
        raise fail(
            f"{path} has no {STATE_FILE}: it is not a complete checkpoint of this recipe (a save that was "
            f"interrupted, or a folder written by another tool). Use an intact checkpoint such as the one named in "
            f"{path.parent / LATEST}, or checkpoint.resume=none to start fresh."
        )
    try:
        saved = json.loads(state_file.read_text())
        version = saved["format_version"]
        manifest = saved["manifest"]
        saved["state"]["step"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise fail(f"{state_file} is not a readable checkpoint state ({err!r}); the checkpoint is damaged.") from None
    if version != FORMAT_VERSION:
        raise fail(f"{state_file} has format_version {version}; this code reads {FORMAT_VERSION}.")
    problems = []
    for rel, size in manifest.items():
        file = path / rel
        if not file.is_file():
            problems.append(f"{rel} is missing")
        elif file.stat().st_size != size:
            problems.append(f"{rel} holds {file.stat().st_size} bytes instead of {size} (truncated or replaced)")
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise fail(
            f"Checkpoint {path} is damaged: {shown}. Resume from an earlier checkpoint with "
            "checkpoint.resume=PATH, or copy the checkpoint again if it was transferred."
        )
    return saved


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder, or the newest one of a run folder / ``checkpoints`` folder given instead."""
    path = Path(path)
    if looks_like_checkpoint(path):
        return path
    for root in (path, path / "checkpoints"):
        if (root / LATEST).is_file():
            return _follow_latest(root)
    return path


def find_resume_checkpoint(resume: str, root: Path) -> Path | None:
    """The checkpoint that ``checkpoint.resume`` names, or None.

    auto: the one ``root/latest`` names (the pointer is the commit point of a save: a folder renamed but not
    yet pointed to when a crash hit is re-saved by the resumed run); without a pointer, the newest complete
    folder. none: None. Anything else: a checkpoint folder, or a run or ``checkpoints`` folder for its newest.
    """
    if resume == "none":
        return None
    if resume != "auto":
        return resolve_checkpoint(resume)
    if (root / LATEST).is_file():
        return _follow_latest(root)
    found = complete_checkpoints(root)
    return found[-1].path if found else None


def prune_checkpoints(root: Path, keep_last: int) -> list[Path]:
    """Delete all but the ``keep_last`` newest checkpoints and the best by validation loss; return the deleted."""
    saved = complete_checkpoints(root)
    scored = [c for c in saved if c.val_loss is not None and math.isfinite(c.val_loss)]
    best = min(scored, key=lambda c: c.val_loss) if scored else None
    keep = {c.path for c in saved[-keep_last:]}
    if best is not None:
        keep.add(best.path)
        write_text_atomic(root / BEST, best.path.name + "\n", durable=True)
    removed = [c.path for c in saved if c.path not in keep]
    for path in removed:
        logger.info("Removing %s (checkpoint.keep_last=%d; the best by validation loss is kept apart)", path, keep_last)
        _remove_tree(path)
    return removed


def _follow_latest(root: Path) -> Path:
    pointer = root / LATEST
    name = pointer.read_text().strip()
    target = root / name
    if not name or not _STEP_DIR.match(name) or not target.is_dir():
        raise fail(
            f"{pointer} points to {name!r}, which is not a checkpoint folder in {root}. Delete {pointer} to use the "
            f"newest complete checkpoint, or pass checkpoint.resume=PATH (or none to start fresh)."
        )
    return target


def _file_sha256(path: Path) -> str | None:
    return file_sha256(path) if path.is_file() else None


def _data_signature(data_dir: Path) -> dict:
    """What must not change between a checkpoint and its resume: the token ids' meaning and width."""
    meta = json.loads((data_dir / "meta.json").read_text())
    return {
        "vocab_size": meta.get("vocab_size"),
        "dtype": meta.get("dtype"),
        "eos_id": meta.get("eos_id"),
        "tokenizer_sha256": _file_sha256(data_dir / "tokenizer.json"),
        "train_sha256": meta.get("splits", {}).get("train", {}).get("sha256"),
    }


def _mixture_key(mixture: list[dict] | None) -> list[tuple] | None:
    """What fixes the order of a mixture: source names (their permutations' seeds) and quotas (the pattern)."""
    return None if mixture is None else [(s["name"], s["quota"]) for s in mixture]


def _describe_mixture(mixture: list[dict] | None) -> str:
    if mixture is None:
        return "one folder (data.path)"
    return "mixture " + ", ".join(f"{s['name']} {s['weight']:.4g}" for s in mixture)


# --------------------------------------------------------------------------------------------------
# RNG state in a safe format (one safetensors file per rank)


def rng_state_tensors() -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """This process's RNG states as tensors + string metadata (exactly restorable, no pickle)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, py_state, gauss_next = random.getstate()
    tensors = {
        "torch_cpu": torch.get_rng_state(),
        "numpy_keys": torch.from_numpy(np.asarray(keys, dtype=np.uint32).astype(np.int64)),
        "python_state": torch.tensor(py_state, dtype=torch.int64),
    }
    if torch.cuda.is_available():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda_{i}"] = state
    metadata = {
        "numpy_kind": kind, "numpy_pos": str(pos), "numpy_has_gauss": str(has_gauss),
        "numpy_cached_gaussian": float(cached).hex(), "python_version": str(version),
        "python_gauss_next": "none" if gauss_next is None else float(gauss_next).hex(),
    }
    return tensors, metadata


def set_rng_state(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    torch.set_rng_state(tensors["torch_cpu"])
    np.random.set_state((
        metadata["numpy_kind"], tensors["numpy_keys"].numpy().astype(np.uint32), int(metadata["numpy_pos"]),
        int(metadata["numpy_has_gauss"]), float.fromhex(metadata["numpy_cached_gaussian"]),
    ))
    gauss = metadata["python_gauss_next"]
    random.setstate((
        int(metadata["python_version"]), tuple(int(v) for v in tensors["python_state"].tolist()),
        None if gauss == "none" else float.fromhex(gauss),
    ))
    cuda = [tensors[f"cuda_{i}"] for i in range(sum(k.startswith("cuda_") for k in tensors))]
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)


def _remove_tree(path: Path) -> None:
    """Delete a checkpoint folder (so that no half-deleted folder ever carries a checkpoint's name) and the
    topology-free form cached beside it."""
    trash = path.with_name(f"{_TRASH_PREFIX}{path.name}")
    if trash.exists():
        shutil.rmtree(trash)
    os.rename(path, trash)
    shutil.rmtree(trash)
    shutil.rmtree(portable_dir(path), ignore_errors=True)


# --------------------------------------------------------------------------------------------------


class Checkpointer:
    """Owns the checkpoint policy: when to save, atomic publishing, retention, resume and the final export.

    Every method is called on every rank; collectives (DeepSpeed's save, the probe forward) run on all of
    them and only the main process writes shared files.
    """

    def __init__(self, section: CheckpointConfig, accelerator, out_dir: Path, *, zero: ZeroSetup, data_dir: str | Path,
                 seq_len: int, mixture: list[dict] | None = None, samples_per_step: int, max_steps: int, run_config: dict, lr_schedule: Callable[[int], float],
                 extra_state=None, publish_timeout_s: float = 1800.0):
        """
        Args:
            section: the recipe's ``checkpoint`` section (interval, retention, resume).
            zero: the run's DeepSpeed setup (recorded, and compared on resume).
            data_dir, seq_len: the training data (its signature is recorded; a probe window is read from it); for a
                mixture, the first source (all share the tokenizer).
            mixture: a data mixture's sources (name, path, weight, quota per block, train sha256), recorded; a resume
                must keep the names and quotas (the global sample index maps to the same source and sample). None
                for one folder.
            samples_per_step: the global batch size (the data position of a step is ``step x samples_per_step``).
            max_steps: the last step of the run, which is always saved.
            run_config: the resolved configuration as a dict, saved with each checkpoint and compared on resume.
            lr_schedule: the learning rate of a step, recorded so a resume can say if it changes.
            extra_state: state saved and restored with each checkpoint besides Accelerate's (the weight EMA): an
                object whose ``save(folder)`` and ``load(folder)`` every rank calls; None for none.
            publish_timeout_s: how long a background write waits for the other ranks' files before failing.
        """
        self.section = section
        self.accelerator = accelerator
        self.out_dir = out_dir
        self.root = out_dir / "checkpoints"
        self.zero = zero
        self.data_dir = Path(data_dir)
        self.mixture = mixture
        self.samples_per_step = samples_per_step
        self.max_steps = max_steps
        self.run_config = run_config
        self.lr_schedule = lr_schedule
        self.extra_state = extra_state
        self.probe_ids = TokenWindows(self.data_dir, "val", seq_len).batch([0])[0][:, :PROBE_TOKENS]
        self.resumed_from: Path | None = None
        self.latest: Path | None = None
        self.publish_timeout_s = publish_timeout_s
        self.background = section.background_save
        self.writer = BackgroundWriter()
        if accelerator.is_main_process:
            self.root.mkdir(parents=True, exist_ok=True)
            for leftover in self.root.iterdir():
                name = leftover.name
                if (name.startswith((_TMP_PREFIX, _TRASH_PREFIX)) or _PORTABLE_LEFTOVER.match(name)) and leftover.is_dir():
                    logger.info("Removing %s, left by an interrupted save or conversion", leftover)
                    shutil.rmtree(leftover)
            (out_dir / PREEMPTED_MARKER).unlink(missing_ok=True)
        accelerator.wait_for_everyone()

    # ---- resume

    def maybe_resume(self, model, optimizer, state) -> str | None:
        """Restore weights, optimizer, training state and every rank's RNG from the chosen checkpoint.

        A checkpoint saved on another layout (process count under DeepSpeed, ZeRO stage, offload, DeepSpeed or
        not) is converted to its topology-free form first (``portable.py``); the log says what changed.
        """
        path = find_resume_checkpoint(self.section.resume, self.root)
        if path is None:
            return None
        saved = read_checkpoint(path)
        self._check_compatible(saved, path, model)
        self._load(path, saved, model, optimizer, state)
        self.resumed_from = self.latest = path
        changes = layout_changes(layout_of(saved["topology"]), self.layout())
        if changes:
            logger.info("Resumed from %s at step %d (%d tokens seen) on a new layout: %s. Weights, AdamW moments and "
                        "step counts were loaded by parameter name; the data continues at sample %d.", path, state.step,
                        state.tokens_seen, "; ".join(changes), saved["data"]["next_sample"])
        else:
            logger.info("Resumed from %s at step %d (%d tokens seen)", path, state.step, state.tokens_seen)
        return str(path)

    def layout(self) -> dict:
        """How this run cuts its optimizer state (recorded in each checkpoint's ``topology``)."""
        return {"world_size": self.accelerator.num_processes, "deepspeed": self.zero.deepspeed,
                "zero_stage": self.zero.stage, "offload_optimizer": self.zero.offload_optimizer,
                "offload_param": self.zero.offload_param}

    def _portable_form(self, path: Path, saved: dict, model) -> Path:
        """The checkpoint's topology-free form: converted once by the main process, cached beside it
        (``step_XXXXXXXX.portable``; the checkpoint itself is not modified).

        A checkpoint in a folder that cannot be written to (read-only storage) gets its cache in this run's
        ``checkpoints/`` instead.
        """
        from accelerate.utils import broadcast_object_list

        acc = self.accelerator
        digest = state_sha256(path, STATE_FILE)
        outcome = [None, None]  # (folder, error) decided by the main process
        if acc.is_main_process:
            saved_layout = layout_of(saved["topology"])
            names = optimizer_param_names(acc.unwrap_model(model), bool(saved["config"]["optim"].get("decay_embeddings")))
            for dest in dict.fromkeys((portable_dir(path), portable_dir(path, self.root))):
                if cached_portable(dest, digest):
                    logger.info("Using the topology-free form of %s cached in %s", path, dest)
                    outcome = [str(dest), None]
                    break
                try:
                    convert(path, dest, deepspeed_dir=path / DS_TAG if saved_layout["deepspeed"] else None,
                            param_names=names, source_layout=saved_layout, source_sha256=digest)
                    outcome = [str(dest), None]
                    break
                except UserError as err:
                    outcome = [None, str(err)]
                    break
                except OSError as err:  # read-only checkpoint storage: try the run's own folder
                    if err.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
                        raise
                    outcome = [None, f"Cannot write the topology-free form of {path} to {dest}: {err}."]
        broadcast_object_list(outcome)
        folder, error = outcome
        if error is not None:
            raise fail(error)
        return Path(folder)

    def _check_compatible(self, saved: dict, path: Path, model) -> None:
        fixed_keys = fixed_on_resume_keys()
        old, new = flatten_config(saved["config"]), flatten_config(self.run_config)
        problems = [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in fixed_keys if old.get(k) != new.get(k)]
        old_hf = saved.get("hf_config", {})
        new_hf = self.accelerator.unwrap_model(model).config.to_dict()
        problems += [f"model config {k}: {old_hf[k]!r} -> {new_hf[k]!r}"
                     for k in _HF_SHAPE_KEYS if k in old_hf and k in new_hf and old_hf[k] != new_hf[k]]
        old_data, new_data = saved.get("data", {}), self._data_signature()
        problems += [f"data {k}: {old_data[k]!r} -> {new_data[k]!r}"
                     for k in ("vocab_size", "dtype", "eos_id", "tokenizer_sha256")
                     if old_data.get(k) is not None and new_data.get(k) is not None and old_data[k] != new_data[k]]
        old_mix, new_mix = _mixture_key(old_data.get("mixture")), _mixture_key(new_data.get("mixture"))
        if old_mix != new_mix:
            problems.append(f"data sources: {_describe_mixture(old_data.get('mixture'))} -> "
                            f"{_describe_mixture(new_data.get('mixture'))}")
        if problems:
            raise fail(
                f"Cannot resume from {path}: this run differs in what the checkpoint's weights, optimizer state or data "
                f"position depend on ({'; '.join(problems)}). Resume with the checkpoint's settings, or start a new run "
                f"from its weights: python tools/export_hf.py {path} EXPORT --dtype fp32, then model.init_from=EXPORT "
                "checkpoint.resume=none."
            )
        changed = [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(set(old) | set(new))
                   if k not in fixed_keys and old.get(k) != new.get(k)]
        if changed:
            logger.info("Resuming with changed settings (allowed): %s", "; ".join(changed))
        if new_mix is None and new_data.get("train_sha256") != old_data.get("train_sha256"):
            logger.warning("The training data differs from the checkpoint's (train.bin sha256); the run continues "
                           "at the same sample index of the new data.")
        for old_source, new_source in zip(old_data.get("mixture") or [], new_data.get("mixture") or []):
            if old_source.get("train_sha256") != new_source.get("train_sha256"):
                logger.warning("The training data of source %s differs from the checkpoint's (%s -> %s, train.bin "
                               "sha256); the run continues at the same sample index of the new data.",
                               new_source["name"], old_source.get("path"), new_source.get("path"))
        step = saved["state"]["step"]
        lr_now = self.lr_schedule(step)
        lr_saved = saved["schedule"]["next_lr"]
        if not math.isclose(lr_now, lr_saved, rel_tol=1e-9, abs_tol=1e-15):
            logger.warning("The learning rate of step %d changes from %.6g (as saved) to %.6g with this recipe's "
                           "schedule.", step, lr_saved, lr_now)

    def _data_signature(self) -> dict:
        signature = _data_signature(self.data_dir)
        return signature if self.mixture is None else {**signature, "mixture": self.mixture}

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

    def restore(self, path: Path, model, optimizer, state) -> None:
        """Reload a checkpoint of this run in-process (a rollback): weights, optimizer, training state, RNG.

        The same loading as a resume, without the compatibility check (the checkpoint is this run's, or the one it
        resumed from, possibly on another layout).
        """
        self._load(path, read_checkpoint(path), model, optimizer, state)
        logger.info("Reloaded %s (step %d)", path, state.step)

    def _load(self, path: Path, saved: dict, model, optimizer, state) -> None:
        """Weights, optimizer, training state, every rank's RNG and the extra state, from checkpoint ``path``."""
        saved_layout = layout_of(saved["topology"])
        if needs_conversion(saved_layout, self.layout()):
            folder = self._portable_form(path, saved, model)
            load_portable(folder, model, optimizer, deepspeed=self.zero.deepspeed, step=saved["state"]["step"],
                          samples_per_step=self.samples_per_step)
        else:
            # load_kwargs: the non-DeepSpeed optimizer and RNG pickles are read with the tensors-only unpickler.
            self.accelerator.load_state(str(path), load_kwargs={"weights_only": True})
        names = {f.name for f in fields(state)}
        for key, value in saved["state"].items():
            if key in names:
                setattr(state, key, value)
        self._restore_rng(path, saved_layout["world_size"])
        if self.extra_state is not None:
            self.extra_state.load(path)

    def best(self) -> Path | None:
        """The complete checkpoint with the lowest validation loss (what ``checkpoints/best`` names), or None."""
        pointer = self.root / BEST
        if not pointer.is_file():
            return None
        path = self.root / pointer.read_text().strip()
        return path if (path / STATE_FILE).is_file() else None

    # ---- save

    def due(self, step: int) -> bool:
        """Whether ``step`` is saved (every ``checkpoint.every_steps`` steps and the last); preemption saves any."""
        every = self.section.every_steps
        return step == self.max_steps or (every > 0 and step % every == 0)

    @torch.no_grad()
    def _probe_logits(self, model) -> torch.Tensor:
        # Every rank runs the forward: ZeRO-3 gathers parameters collectively.
        was_training = model.training
        model.eval()
        logits = model(input_ids=self.probe_ids.to(self.accelerator.device)).logits.float().cpu()
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
        tmp = self.root / f"{_TMP_PREFIX}{final.name}"
        if acc.is_main_process:
            if tmp.exists():
                shutil.rmtree(tmp)
            (tmp / RNG_DIR).mkdir(parents=True)
        acc.wait_for_everyone()
        probe = self._probe_logits(model)
        try:
            # The small files, in the loop also with background writes: this rank's RNG state, the probe and hf/
            # (main process), the extra state (see ema.py for its size).
            tensors, metadata = rng_state_tensors()
            save_file(tensors, tmp / RNG_DIR / f"rank_{acc.process_index:05d}.safetensors", metadata=metadata)
            if acc.is_main_process:
                save_file({"input_ids": self.probe_ids.contiguous(), "logits": probe.contiguous()}, tmp / PROBE_FILE)
                self._write_hf_dir(model, tmp / HF_DIR)
            if self.extra_state is not None:
                self.extra_state.save(tmp)
            if self.background:
                frozen = type(state)(**{f.name: json.loads(json.dumps(getattr(state, f.name))) for f in fields(state)})
                self.writer.submit(self._write_in_background, self._snapshot(model, tmp), tmp, final, frozen)
            else:
                acc.save_state(str(tmp))  # on every rank: DeepSpeed's save has collectives, a main-only save hangs
                acc.wait_for_everyone()
                if acc.is_main_process:
                    self._publish(tmp, final, state)
        except (OSError, RuntimeError) as err:
            full = self._disk_full_error(err, tmp, final)
            if full is None:
                raise
            raise full from None
        if self.background and not (preempted or state.step >= self.max_steps):
            return final
        self.wait()
        if acc.is_main_process and preempted:
            marker = {"step": state.step, "checkpoint": str(final)}
            write_text_atomic(self.out_dir / PREEMPTED_MARKER, json.dumps(marker) + "\n", durable=True)
        acc.wait_for_everyone()
        self.latest = final
        return final

    def wait(self) -> None:
        """Block until the checkpoint written in the background (if any) is published, on every rank."""
        if not self.writer.pending:
            return
        final = self.writer.wait()  # raises what the write raised (a full disk becomes its UserError)
        self.accelerator.wait_for_everyone()  # the main process returns only once it has published
        self.latest = final

    def _snapshot(self, model, tmp: Path) -> Callable[[], None]:
        """Copy this rank's model and optimizer state to CPU memory (the loop waits for this only); return the
        write of that copy into ``tmp``, for the worker thread."""
        acc = self.accelerator
        if not self.zero.deepspeed:
            return functools.partial(write_accelerator_state, snapshot_accelerator_state(acc), tmp)
        # The collective part of DeepSpeed's save runs now, on every rank; its files are copied, not written.
        with deepspeed_writes_captured(model, pin_memory=acc.device.type == "cuda") as captured:
            acc.save_state(str(tmp))
        if acc.device.type == "cuda":
            torch.cuda.synchronize(acc.device)  # the copies were queued non-blocking into pinned memory
        return functools.partial(write_captured, captured, getattr(model.checkpoint_engine, "zipfile_serialization", True))

    def _write_in_background(self, write: Callable[[], None], tmp: Path, final: Path, state) -> Path:
        """On the worker thread: this rank's files and its marker; on the main process, then the publication."""
        rank = self.accelerator.process_index
        try:
            write()
            del write  # the CPU copy
            (tmp / _DONE.format(rank)).touch()
            if self.accelerator.is_main_process:
                self._await_ranks(tmp)
                self._publish(tmp, final, state)
        except (OSError, RuntimeError) as err:
            if tmp.is_dir():
                (tmp / _FAILED.format(rank)).write_text(f"{err!r}\n")
            full = self._disk_full_error(err, tmp, final)
            if full is None:
                raise
            raise full from None
        return final

    def _await_ranks(self, tmp: Path) -> None:
        """Wait for every rank's marker in ``tmp`` (a barrier through the shared filesystem), then remove them."""
        ranks = range(self.accelerator.num_processes)
        deadline = time.monotonic() + self.publish_timeout_s
        orphaned = False
        while not all((tmp / _DONE.format(r)).is_file() for r in ranks):
            failed = [r for r in ranks if (tmp / _FAILED.format(r)).is_file()]
            if failed:
                raise RuntimeError(f"rank {failed[0]} failed to write its part of {tmp}: "
                                   f"{(tmp / _FAILED.format(failed[0])).read_text().strip()}")
            if not orphaned and not threading.main_thread().is_alive():  # the run ended with an error
                orphaned, deadline = True, min(deadline, time.monotonic() + 60)
            if time.monotonic() > deadline:
                raise RuntimeError(f"not every rank wrote its part of {tmp} in time; the checkpoint is not published")
            time.sleep(0.02)
        for r in ranks:
            (tmp / _DONE.format(r)).unlink()

    def _disk_full_error(self, err: Exception, tmp: Path, final: Path):
        """A UserError if ``err`` came from a full disk (after removing the partial folder), else None.

        torch's writer reports a full disk as a RuntimeError without errno ("iostream error"), so the free space is
        checked too: less than the previous checkpoint's size (or 1 MB without one) counts as full.
        """
        previous = self.latest
        if previous is None and (self.root / LATEST).is_file():
            previous = _follow_latest(self.root)
        needed = sum(p.stat().st_size for p in previous.rglob("*") if p.is_file()) if previous else 0
        try:
            free = shutil.disk_usage(self.root).free
        except OSError:
            free = 0
        if getattr(err, "errno", None) not in (errno.ENOSPC, errno.EDQUOT) and free >= max(needed, 1 << 20):
            return None
        shutil.rmtree(tmp, ignore_errors=True)
        kept = f"The previous checkpoint {previous} is intact." if previous else "No earlier checkpoint exists."
        return fail(
            f"No space left on the device while writing checkpoint {final.name} to {self.root} ({err}). "
            f"Free: {free / 1e6:.1f} MB; the previous checkpoint took {needed / 1e6:.1f} MB. The partial folder was "
            f"removed. {kept} Free some space, lower checkpoint.keep_last, or move out_dir to a larger disk, then "
            "resume with checkpoint.resume=auto."
        )

    def _write_hf_dir(self, model, hf_dir: Path) -> None:
        hf_dir.mkdir()
        self.accelerator.unwrap_model(model).config.to_json_file(hf_dir / "config.json")
        for file in self.data_dir.iterdir():
            if file.is_file() and file.suffix not in (".bin", ".idx"):  # tokenizer files and meta.json, not the tokens
                shutil.copy2(file, hf_dir / file.name)

    def _publish(self, tmp: Path, final: Path, state) -> None:
        val_loss = state.last_val_loss if state.last_val_step == state.step else None
        manifest = {p.relative_to(tmp).as_posix(): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
        payload = {
            "format_version": FORMAT_VERSION,
            "state": {f.name: getattr(state, f.name) for f in fields(state)},
            "val_loss": val_loss,
            "data": {"next_sample": data_step(state.step, getattr(state, "skipped_batches", ())) * self.samples_per_step,
                     **self._data_signature()},
            "schedule": {
                "last_lr": self.lr_schedule(state.step - 1) if state.step else None,
                "next_lr": self.lr_schedule(state.step),
            },
            "topology": self.layout(),
            "hf_config": json.loads((tmp / HF_DIR / "config.json").read_text()),
            "config": self.run_config,
            "manifest": manifest,
        }
        write_text_atomic(tmp / STATE_FILE, json.dumps(payload, indent=2) + "\n", durable=True)
        if final.exists():
            # A step saved before by an abandoned continuation (resumed from an older checkpoint, or resume=none
            # in a used out_dir): aim `latest` at a folder that stays complete before deleting this one.
            if self.latest is not None and self.latest.parent == self.root:
                write_text_atomic(self.root / LATEST, self.latest.name + "\n", durable=True)
            else:
                (self.root / LATEST).unlink(missing_ok=True)
            _remove_tree(final)
        os.rename(tmp, final)
        fsync_dir(self.root)
        write_text_atomic(self.root / LATEST, final.name + "\n", durable=True)
        logger.info("Saved checkpoint %s", final)
        prune_checkpoints(self.root, self.section.keep_last)
