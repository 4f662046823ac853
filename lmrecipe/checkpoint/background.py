"""Background checkpoint writes: copy the training state to CPU memory at the step, write the files on a thread.

Without DeepSpeed, ``accelerator.save_state`` does two things on the training path: it reads the model and
optimizer state off the device and it serialises them to files. Only the first has to happen at the step being
saved. :func:`snapshot_accelerator_state` copies what ``save_state`` would write (model state dicts, optimizer
state dicts, the GradScaler's state) into CPU memory, pinned on CUDA, with one device synchronisation; the
loop then goes on while :func:`write_accelerator_state` hands the copies to Accelerate's own writer
(``save_accelerator_state``), so the files are the ones ``save_state`` writes and ``load_state`` reads them.

:class:`BackgroundWriter` runs one such write at a time on a worker thread; its error, if any, comes back to the
caller at the next :meth:`BackgroundWriter.wait`. Publishing (the ``train_state.json`` manifest, the rename and
the ``latest`` pointer) stays with the store (``storage.py``).

Under DeepSpeed, ``save_state`` runs the engine's ``save_checkpoint``, a collective (ZeRO-3 gathers, every rank
takes part) whose files go through the engine's checkpoint engine. :func:`deepspeed_writes_captured` swaps that
engine for one whose ``save(state_dict, path)`` copies the state dict to CPU memory and records it: the collective
part runs at the step as before, and :func:`write_captured` later writes the same files with ``torch.save`` on the
worker thread. (DeepSpeed's own ``DecoupledCheckpointEngine`` waits for its write at the next step, so it overlaps
one step only.)

Memory: the copy holds one extra set of weights and optimizer states in host memory while a write is in flight
(under ZeRO, this rank's shards).
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch


def copy_to_cpu(obj: Any, pin_memory: bool = False, memo: dict | None = None) -> Any:
    """``obj`` with every tensor replaced by a CPU copy; containers keep their type, shared storage stays shared.

    Tensors that are views of the same memory (tied embeddings) map to one copy, so Accelerate's safetensors
    writer drops the duplicate exactly as it does for the live state dict.
    """
    memo = {} if memo is None else memo
    if isinstance(obj, torch.Tensor):
        key = (obj.device, obj.untyped_storage().data_ptr(), obj.storage_offset(), tuple(obj.shape), obj.stride(), obj.dtype)
        if key not in memo:
            source = obj.detach()
            if source.device.type == "cpu":
                memo[key] = source.clone()
            else:
                target = torch.empty_like(source, device="cpu", pin_memory=pin_memory)
                memo[key] = target.copy_(source, non_blocking=pin_memory)
        return memo[key]
    if isinstance(obj, OrderedDict):
        return OrderedDict((k, copy_to_cpu(v, pin_memory, memo)) for k, v in obj.items())
    if isinstance(obj, dict):
        return {k: copy_to_cpu(v, pin_memory, memo) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(copy_to_cpu(v, pin_memory, memo) for v in obj)
    return obj


class _Frozen:
    """What Accelerate's writer asks a live optimizer or scaler for: ``state_dict()``, here a CPU copy."""

    def __init__(self, state: dict):
        self._state = state

    def state_dict(self) -> dict:
        return self._state


@dataclass
class AcceleratorSnapshot:
    """CPU copies of what ``accelerator.save_state`` writes without DeepSpeed."""

    weights: list[dict]
    optimizers: list[dict]
    scaler: dict | None
    process_index: int
    step: int


def snapshot_accelerator_state(accelerator) -> AcceleratorSnapshot:
    """Copy the models', optimizers' and scaler's state to CPU memory (the only part of a save on the training path).

    The same objects ``save_state`` reads: ``get_state_dict(model, unwrap=False)`` for each prepared model, each
    prepared optimizer's ``state_dict()``. On CUDA the copies go to pinned memory and one synchronisation waits for
    them; on a CPU they are plain copies.
    """
    cuda = accelerator.device.type == "cuda"
    memo: dict = {}
    weights = [copy_to_cpu(accelerator.get_state_dict(model, unwrap=False), cuda, memo) for model in accelerator._models]
    optimizers = [copy_to_cpu(optimizer.state_dict(), cuda, memo) for optimizer in accelerator._optimizers]
    scaler = copy_to_cpu(accelerator.scaler.state_dict()) if accelerator.scaler is not None else None
    if cuda:
        torch.cuda.synchronize(accelerator.device)  # the copies above were queued non-blocking into pinned memory
    return AcceleratorSnapshot(weights, optimizers, scaler, accelerator.process_index, accelerator.step)


def write_accelerator_state(snapshot: AcceleratorSnapshot, folder: Path) -> None:
    """Write ``snapshot`` into ``folder`` as ``accelerator.save_state`` would (the main process writes the weights)."""
    from accelerate.checkpointing import save_accelerator_state

    save_accelerator_state(str(folder), snapshot.weights, [_Frozen(s) for s in snapshot.optimizers], [], [],
                           snapshot.process_index, snapshot.step,
                           _Frozen(snapshot.scaler) if snapshot.scaler is not None else None)


@contextlib.contextmanager
def deepspeed_writes_captured(engine, pin_memory: bool = False) -> Iterator[list[tuple[str, Any]]]:
    """Within the block, the DeepSpeed ``engine``'s checkpoint files are not written: each is copied to CPU memory
    and recorded as ``(path, state_dict)`` in the yielded list, for :func:`write_captured`. Folders and DeepSpeed's
    small ``latest`` file are still created at once."""
    original = engine.checkpoint_engine
    captured: list[tuple[str, Any]] = []

    class Capturing:
        def __getattr__(self, name: str) -> Any:
            return getattr(original, name)

        def save(self, state_dict, path: str) -> None:
            captured.append((path, copy_to_cpu(state_dict, pin_memory)))

        def preserves_storage_sharing(self) -> bool:
            return False  # copy_to_cpu gives every view its own storage already (DeepSpeed would clone again)

    engine.checkpoint_engine = Capturing()
    try:
        yield captured
    finally:
        engine.checkpoint_engine = original


def write_captured(captured: list[tuple[str, Any]], zipfile_serialization: bool = True) -> None:
    """Write what :func:`deepspeed_writes_captured` recorded, as DeepSpeed's ``TorchCheckpointEngine`` would."""
    for path, state_dict in captured:
        torch.save(state_dict, path, _use_new_zipfile_serialization=zipfile_serialization)


class BackgroundWriter:
    """At most one write in flight, on a worker thread; :meth:`wait` returns its result or raises its error.

    The thread is not a daemon: an interpreter that exits (an error elsewhere) lets the write finish first, so
    the checkpoint is published or, if the process is killed, left as a temporary folder the next run removes.
    """

    def __init__(self, name: str = "checkpoint-writer"):
        self.name = name
        self._future: Future | None = None

    @property
    def pending(self) -> bool:
        return self._future is not None

    def submit(self, fn: Callable[..., Any], *args) -> None:
        """Run ``fn(*args)`` on a new worker thread; the previous write must have been waited for."""
        if self._future is not None:
            raise RuntimeError("a background write is still in flight: wait() for it first")
        future: Future = Future()

        def run() -> None:
            try:
                future.set_result(fn(*args))
            except BaseException as err:  # handed to the waiting caller, never lost on the thread
                future.set_exception(err)

        self._future = future
        threading.Thread(target=run, name=self.name, daemon=False).start()

    def wait(self) -> Any:
        """Block until the write in flight (if any) is done; return its result, or raise what it raised."""
        future, self._future = self._future, None
        return None if future is None else future.result()
