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
  ZeRO-3; see ``lmrecipe/train/ema.py``), written through the loop features' ``extras``;
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

import json
import logging
import math
import os
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from lmrecipe.checkpoint.portable import (
    portable_dir,
)
from lmrecipe.data.format import file_sha256
from lmrecipe.errors import fail
from lmrecipe.fileio import write_text_atomic

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


def step_of_dir(name: str) -> int | None:
    """The step of a checkpoint folder's name (``step_00000100`` -> 100), or None for any other name."""
    match = _STEP_DIR.match(name)
    return int(match.group(1)) if match else None


def complete_checkpoints(root: Path) -> list[SavedCheckpoint]:
    """Published checkpoints under ``root``, oldest first (folders still being written are not listed)."""
    found = []
    if not root.is_dir():
        return found
    for path in root.iterdir():
        step = step_of_dir(path.name)
        if step is not None and (path / STATE_FILE).is_file():
            try:
                val_loss = json.loads((path / STATE_FILE).read_text()).get("val_loss")
            except (OSError, json.JSONDecodeError):
                val_loss = None
            found.append(SavedCheckpoint(step, path, val_loss))
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
    if step_of_dir(name) is None or not target.is_dir():
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
