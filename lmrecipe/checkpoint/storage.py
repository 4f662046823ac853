"""Resumable checkpoints: atomic saves, exact resume, retention, and the marker a preempted run leaves.

Layout of ``out_dir/checkpoints/``::

    step_00000100/              one complete checkpoint (see below)
    latest                      name of the newest complete checkpoint; replaced atomically, written last
    best                        name of the checkpoint with the lowest validation loss; never pruned

A checkpoint folder holds what ``accelerator.save_state`` writes (DeepSpeed's per-rank ZeRO shards under
``pytorch_model/``, or ``model.safetensors`` + ``optimizer.bin`` without DeepSpeed) and:

- ``rng/rank_NNNNN.safetensors``: the torch (CPU and CUDA), numpy and ``random`` RNG state of every rank (``rng.py``);
- ``hf/``: the transformers ``config.json``, the tokenizer files and the data's ``meta.json``, so an export
  or an evaluation needs neither the recipe's data folder nor ``model.init_from``;
- ``probe.safetensors``: logits of the training-time model on a fixed input, to check exports against;
- with ``train.ema_decay`` > 0, the weight EMA (``ema.safetensors``, or ``ema/rank_NNNNN.safetensors`` under
  ZeRO-3; see ``lmrecipe/train/callbacks/ema.py``), written through the trainer's callbacks' ``extras``;
- ``train_state.json``: step, tokens seen, data position, best validation loss, the schedule's values, the
  resolved config, the topology, a manifest of every file with its size, and the sha256 of every file up to
  ``CHECKSUM_MAX_BYTES``. Written last.

Atomicity: every rank writes into ``.tmp_step_N``; after a barrier the main process writes
``train_state.json`` and renames the folder to ``step_N``, then replaces ``latest``. A crash or ``kill -9``
at any moment leaves the previous checkpoint and the pointer intact; leftovers are removed at the next start.
The checkpoint folder must be on a filesystem every rank sees (a shared filesystem on multi-node jobs).

Background writes (``checkpoint.background_save``): at the step, every rank copies its state to CPU memory
(``background.py``; under DeepSpeed, after the collective part of its save) and returns to training; a worker
thread writes the copy into ``.tmp_step_N`` and then a marker ``.rank_NNNNN.done``. The main process's worker
waits for every rank's marker (the barrier of a synchronous save, without stopping the loop), removes the markers
and publishes as above. So the order of the commit (files, ``train_state.json`` last, rename, ``latest``) is the
same, and a ``kill -9`` during a background write leaves the previous checkpoint complete. One write is in flight
at most: the next save, a rollback, a preemption and the end of the run wait for it (:meth:`CheckpointStore.wait`).

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
import re
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors import SafetensorError

from lmrecipe.checkpoint.background import (
    BackgroundWriter,
    deepspeed_writes_captured,
    snapshot_accelerator_state,
    write_accelerator_state,
    write_captured,
)
from lmrecipe.checkpoint.portable import (
    portable_dir,
)
from lmrecipe.data.format import file_sha256
from lmrecipe.errors import fail
from lmrecipe.fileio import fsync_dir, give_new_file_mode, write_text_atomic

logger = logging.getLogger(__name__)

#: Exit code of every training process after a SIGTERM/SIGUSR1 stop with a checkpoint saved (after Ctrl-C: 130,
#: ``lmrecipe.errors.EXIT_INTERRUPTED``); a requeued job resumes with the default ``checkpoint.resume=auto``.
#: Launchers (torchrun, accelerate launch) report any failed worker as exit 1 (slurm/launch.sh restores 124), so the
#: main process also writes ``out_dir/preempted.json`` ({"step", "checkpoint"}); the next run removes it when it starts.
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
TMP_PREFIX = ".tmp_"
_PORTABLE_LEFTOVER = re.compile(r"^step_\d{8,}\.portable\.(tmp|old)-\d+$")
"""A topology-free form being built (``fileio.building_dir``) or replaced when a conversion was interrupted."""
_TRASH_PREFIX = ".trash_"
DONE_MARKER = ".rank_{:05d}.done"
CHECKSUM_MAX_BYTES = 64 << 20
"""Files up to this size get a sha256 in ``train_state.json`` (checked on every read: cheap for them). Larger ones
(weights, optimizer states, ZeRO shards) are checked by size and, for safetensors, by header: hashing them would
read every checkpoint twice."""
FAILED_MARKER = ".rank_{:05d}.failed"



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
            f"interrupted, or a folder written by another tool). {use_earlier(path)}"
        )
    try:
        saved = json.loads(state_file.read_text())
        version = saved["format_version"]
        saved["state"]["step"]
        manifest_sizes(saved)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise fail(f"{state_file} is not a readable checkpoint state ({err!r}); the checkpoint is damaged. "
                   f"{use_earlier(path)}") from None
    if version != FORMAT_VERSION:
        raise fail(f"{state_file} has format_version {version}; this code reads {FORMAT_VERSION}.")
    if problems := manifest_problems(path, saved):
        raise fail(f"Checkpoint {path} is damaged: {summary(problems)}. {use_earlier(path)} Or copy the checkpoint "
                   "again if it was transferred.")
    return saved


def manifest_problems(path: Path, saved: dict) -> list[str]:
    """What is wrong with the files of checkpoint folder ``path`` against its manifest (``saved``: its
    ``train_state.json``): missing, of another size, a safetensors header that does not describe its bytes, a
    sha256 that differs; empty when every file is whole."""
    problems = []
    checksums = saved.get("sha256") if isinstance(saved.get("sha256"), dict) else {}
    for rel, size in manifest_sizes(saved).items():
        file = path / rel
        if not file.is_file():
            problems.append(f"{rel} is missing")
        elif file.stat().st_size != size:
            problems.append(f"{rel} holds {file.stat().st_size} bytes instead of {size} (truncated or replaced)")
        elif rel.endswith(".safetensors") and (bad := safetensors_problem(file)) is not None:
            problems.append(f"{rel} {bad} (its size is right, its content is not)")
        elif rel in checksums and file_sha256(file) != checksums[rel]:
            problems.append(f"{rel} does not match its sha256 (its size is right, its content is not)")
    return problems


def manifest_sizes(saved: dict) -> dict[str, int]:
    """A checkpoint's files by relative path, with their sizes (``saved``: its ``train_state.json``); KeyError,
    TypeError, ValueError or AttributeError when the manifest is not one."""
    return {str(rel): int(size) for rel, size in saved["manifest"].items()}


def summary(problems: list[str]) -> str:
    """The first five of a checkpoint's ``problems``, and how many more."""
    return "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")


def use_earlier(path: Path) -> str:
    """The way out of a damaged checkpoint ``path``: the newest complete checkpoint before it, if there is one."""
    step = step_of_dir(path.name)
    earlier = [c.path for c in complete_checkpoints(path.parent) if step is None or c.step < step]
    target = str(earlier[-1]) if earlier else "PATH"
    found = "" if earlier else " (none is left beside it)"
    return (f"Use an earlier checkpoint{found}: resume training with checkpoint.resume={target} (or "
            f"checkpoint.resume=none to start fresh), or pass it to tools/export_hf.py or eval.py.")


def safetensors_problem(path: Path) -> str | None:
    """What is wrong with the header of safetensors file ``path`` (a cheap read of its first bytes), or None."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(8)
            header_len = int.from_bytes(head, "little") if len(head) == 8 else -1
            if not 0 < header_len <= path.stat().st_size - 8:
                return "has an impossible header length"
            header = json.loads(fh.read(header_len).decode("utf-8"))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError) as err:
        return f"has an unreadable header ({type(err).__name__})"
    if 8 + header_len + end != path.stat().st_size:
        return "has a header that does not describe its bytes"
    return None


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder, or the newest one of a run folder / ``checkpoints`` folder given instead."""
    path = Path(path)
    if looks_like_checkpoint(path):
        return path
    for root in (path, path / "checkpoints"):
        if (root / LATEST).is_file():
            return _follow_latest(root)
        if (found := complete_checkpoints(root)):
            return found[-1].path
    return path


def no_checkpoint_message(path: Path) -> str:
    """Why ``path`` (as given) names no checkpoint: it is absent, or neither a checkpoint nor a folder holding one."""
    if not path.exists():
        return f"{str(path)!r} does not exist."
    if not path.is_dir():
        return f"{path} is a file, not a checkpoint folder."
    return (f"{path} is not a training checkpoint (no {STATE_FILE}) and holds none (no {LATEST} pointer, no "
            "step_N folder, neither in it nor in its checkpoints/).")


def find_resume_checkpoint(resume: str, root: Path) -> Path | None:
    """The checkpoint that ``checkpoint.resume`` names, or None.

    auto: the one ``root/latest`` names (the pointer is the commit point of a save: a folder renamed but not
    yet pointed to when a crash hit is re-saved by the resumed run); without a pointer, the newest complete
    folder. none: None. Anything else: a checkpoint folder, or a run or ``checkpoints`` folder for its newest.
    """
    if resume == "none":
        return None
    if resume != "auto":
        path = resolve_checkpoint(resume)
        if not looks_like_checkpoint(path):
            raise fail(f"checkpoint.resume={resume}: {no_checkpoint_message(Path(resume))} Pass a checkpoint folder "
                       "(out_dir/checkpoints/step_N) or a run folder that saved one, checkpoint.resume=auto for this "
                       "out_dir's newest, or checkpoint.resume=none to start fresh.")
        return path
    if (root / LATEST).is_file():
        return _follow_latest(root)
    found = complete_checkpoints(root)
    return found[-1].path if found else None


def prune_checkpoints(root: Path, keep_last: int, pinned: frozenset[Path] = frozenset()) -> list[Path]:
    """Delete all but the ``keep_last`` newest checkpoints, the best by validation loss and the ``pinned`` ones (an
    upload to ``checkpoint.remote`` reading them); return the deleted."""
    saved = complete_checkpoints(root)
    scored = [c for c in saved if c.val_loss is not None and math.isfinite(c.val_loss)]
    best = min(scored, key=lambda c: c.val_loss) if scored else None
    keep = {c.path for c in saved[-keep_last:]} | set(pinned)
    if best is not None:
        keep.add(best.path)
        write_text_atomic(root / BEST, best.path.name + "\n", durable=True)
    removed = [c.path for c in saved if c.path not in keep]
    for path in removed:
        logger.info("Removing %s (checkpoint.keep_last=%d; the best by validation loss is kept apart)", path, keep_last)
        _remove_tree(path)
    return removed


def follow_pointer(pointer: Path, fix: str) -> Path:
    """The checkpoint folder a ``latest`` or ``best`` pointer file names; UserError ending in ``fix`` when it names
    none beside it."""
    name = pointer.read_text().strip()
    target = pointer.parent / name
    if step_of_dir(name) is None or not target.is_dir():
        raise fail(f"{pointer} points to {name!r}, which is not a checkpoint folder in {pointer.parent}. {fix}")
    return target


def _follow_latest(root: Path) -> Path:
    pointer = root / LATEST
    return follow_pointer(pointer, f"Delete {pointer} to use the newest complete checkpoint, or pass "
                                   "checkpoint.resume=PATH (or none to start fresh).")


def _remove_tree(path: Path) -> None:
    """Delete a checkpoint folder (so that no half-deleted folder ever carries a checkpoint's name) and the
    topology-free form cached beside it."""
    trash = path.with_name(f"{_TRASH_PREFIX}{path.name}")
    if trash.exists():
        shutil.rmtree(trash)
    os.rename(path, trash)
    shutil.rmtree(trash)
    shutil.rmtree(portable_dir(path), ignore_errors=True)


class CheckpointStore:
    """The checkpoint folder's files: write a checkpoint (in this thread or on a worker thread), publish it
    atomically, point ``latest`` at it, prune; the disk-full diagnosis. What to save and when is decided in
    ``saving.py``.

    Every rank writes its files into ``.tmp_step_N``; the main process publishes once every rank is done (after a
    barrier, or, for a background write, once every rank's marker ``.rank_NNNNN.done`` is there).
    """

    def __init__(self, accelerator, root: Path, *, keep_last: int, background: bool, deepspeed: bool,
                 publish_timeout_s: float):
        self.accelerator = accelerator
        self.root = root
        self.keep_last = keep_last
        self.background = background
        self.deepspeed = deepspeed
        self.publish_timeout_s = publish_timeout_s
        self.writer = BackgroundWriter()
        self.latest: Path | None = None
        """The newest checkpoint published (or resumed from) by this run."""
        self.pinned: set[Path] = set()
        """Checkpoints the next prune keeps whatever ``keep_last`` says (uploads in flight; main process)."""
        if self.root.is_dir() and not os.access(self.root, os.W_OK | os.X_OK):  # every rank, before any step
            raise fail(f"{self.root} cannot be written: that folder is read-only for this user, so no checkpoint of "
                       "this run could be saved. Give it write permission (chmod u+w, or remount read-write), or copy "
                       "the run folder to a writable disk and run the same command with out_dir=COPY.")
        if accelerator.is_main_process:
            self.root.mkdir(parents=True, exist_ok=True)
            for leftover in self.root.iterdir():
                name = leftover.name
                if (name.startswith((TMP_PREFIX, _TRASH_PREFIX)) or _PORTABLE_LEFTOVER.match(name)) and leftover.is_dir():
                    logger.info("Removing %s, left by an interrupted save or conversion", leftover)
                    shutil.rmtree(leftover)

    def begin(self, final: Path) -> Path:
        """A fresh temporary folder for checkpoint ``final`` (every rank; the main process creates it)."""
        tmp = self.root / f"{TMP_PREFIX}{final.name}"
        if self.accelerator.is_main_process:
            if tmp.exists():
                shutil.rmtree(tmp)
            (tmp / RNG_DIR).mkdir(parents=True)
        self.accelerator.wait_for_everyone()
        return tmp

    def write(self, model, tmp: Path, final: Path, record: dict) -> None:
        """Accelerate's state into ``tmp`` and the publication: now, or on the worker thread (background writes)."""
        acc = self.accelerator
        if self.background:
            self.writer.submit(self._write_in_background, self._snapshot(model, tmp), tmp, final, record)
            return
        acc.save_state(str(tmp))  # on every rank: DeepSpeed's save has collectives, a main-only save hangs
        acc.wait_for_everyone()
        if acc.is_main_process:
            self.publish(tmp, final, record)

    def best(self) -> Path | None:
        """The complete checkpoint with the lowest validation loss (what ``checkpoints/best`` names), or None."""
        pointer = self.root / BEST
        if not pointer.is_file():
            return None
        path = self.root / pointer.read_text().strip()
        return path if (path / STATE_FILE).is_file() else None

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
        if not self.deepspeed:
            return functools.partial(write_accelerator_state, snapshot_accelerator_state(acc), tmp)
        # The collective part of DeepSpeed's save runs now, on every rank; its files are copied, not written.
        with deepspeed_writes_captured(model, pin_memory=acc.device.type == "cuda") as captured:
            acc.save_state(str(tmp))
        if acc.device.type == "cuda":
            torch.cuda.synchronize(acc.device)  # the copies were queued non-blocking into pinned memory
        return functools.partial(write_captured, captured, getattr(model.checkpoint_engine, "zipfile_serialization", True))

    def _write_in_background(self, write: Callable[[], None], tmp: Path, final: Path, record: dict) -> Path:
        """On the worker thread: this rank's files and its marker; on the main process, then the publication."""
        rank = self.accelerator.process_index
        try:
            write()
            del write  # the CPU copy
            (tmp / DONE_MARKER.format(rank)).touch()
            if self.accelerator.is_main_process:
                self._await_ranks(tmp)
                self.publish(tmp, final, record)
        except (OSError, RuntimeError, SafetensorError) as err:  # safetensors' writer raises its own error
            try:  # tells the main process to stop waiting; on a full disk even this may not fit
                (tmp / FAILED_MARKER.format(rank)).write_text(f"{err!r}\n")
            except OSError:
                pass
            full = self.disk_full_error(err, tmp, final)
            if full is None:
                raise
            raise full from None
        return final

    def _await_ranks(self, tmp: Path) -> None:
        """Wait for every rank's marker in ``tmp`` (a barrier through the shared filesystem), then remove them."""
        ranks = range(self.accelerator.num_processes)
        deadline = time.monotonic() + self.publish_timeout_s
        orphaned = False
        while not all((tmp / DONE_MARKER.format(r)).is_file() for r in ranks):
            if not tmp.is_dir():  # another rank met a full disk and removed the partial folder
                raise RuntimeError(f"{tmp} was removed by a rank whose write failed; the checkpoint is not published")
            failed = [r for r in ranks if (tmp / FAILED_MARKER.format(r)).is_file()]
            if failed:
                raise RuntimeError(f"rank {failed[0]} failed to write its part of {tmp}: "
                                   f"{(tmp / FAILED_MARKER.format(failed[0])).read_text().strip()}")
            if not orphaned and not threading.main_thread().is_alive():  # the run ended with an error
                orphaned, deadline = True, min(deadline, time.monotonic() + 60)
            if time.monotonic() > deadline:
                raise RuntimeError(f"not every rank wrote its part of {tmp} in time; the checkpoint is not published")
            time.sleep(0.02)
        for r in ranks:
            (tmp / DONE_MARKER.format(r)).unlink()

    def disk_full_error(self, err: Exception, tmp: Path, final: Path):
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
        code = getattr(err, "errno", None)
        if code is None and (found := re.search(r"(?:os error |code: )(\d+)", str(err))):
            code = int(found.group(1))  # safetensors' SafetensorError: "IoError(Os { code: 28, kind: StorageFull ..."
        if code not in (errno.ENOSPC, errno.EDQUOT) and free >= max(needed, 1 << 20):
            return None
        shutil.rmtree(tmp, ignore_errors=True)
        kept = f"The previous checkpoint {previous} is intact." if previous else "No earlier checkpoint exists."
        return fail(
            f"No space left on the device while writing checkpoint {final.name} to {self.root} ({err}). "
            f"Free: {free / 1e6:.1f} MB; the previous checkpoint took {needed / 1e6:.1f} MB. The partial folder was "
            f"removed. {kept} Free some space, lower checkpoint.keep_last, or move out_dir to a larger disk, then "
            "resume with checkpoint.resume=auto."
        )

    def publish(self, tmp: Path, final: Path, record: dict) -> None:
        """Main process: write ``train_state.json`` (``record`` and the manifest) last, rename ``tmp`` to ``final``, point
        ``latest`` at it, prune."""
        give_new_file_mode(tmp)  # safetensors writes its files 0600; a checkpoint is as readable as any file
        manifest = {p.relative_to(tmp).as_posix(): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
        payload = {
            "format_version": FORMAT_VERSION,
            **record,
            "manifest": manifest,
            "sha256": {rel: file_sha256(tmp / rel) for rel, size in manifest.items() if size <= CHECKSUM_MAX_BYTES},
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
        prune_checkpoints(self.root, self.keep_last, frozenset(self.pinned))
