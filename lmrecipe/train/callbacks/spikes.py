"""Long runs that heal themselves: loss-spike detection, rollback to the last checkpoint, and skipping the batches.

The rule (``spike`` section), evaluated on the device at every optimizer step, so unlogged steps stay free of host
syncs: the step's loss, averaged over ranks (one tiny all-reduce, asynchronous on GPUs), and its pre-clip global
gradient norm (already the same on every rank) are compared with a trailing window of the last ``spike.window``
steps that were not flagged. A step is a spike when

- its loss is not finite, or its gradient norm is not finite (except under fp16 loss scaling, where an overflow is
  routine and the GradScaler handles it), or
- the window holds at least ``spike.min_history`` steps and the loss lies more than ``spike.z_threshold`` standard
  deviations above the window's mean (the deviation is floored at 0.1% of the mean, so a flat curve does not turn
  noise into spikes); with ``spike.grad_norm_z_threshold`` set, the same for the gradient norm.

Flagged steps do not enter the window. The flags and values of the steps since the last sync point are read at
the loop's next sync point (a logged, evaluated or saved step; one host read, then a max-reduce so every rank
acts alike). The trade-off: a spike is acted on up to ``logging.log_every_steps`` steps after it happened, and the
steps in between are trained and then discarded. Reading a flag every step would stall a GPU every step.

On a spike, at that sync point, every rank:

1. waits for a checkpoint write in flight, then reloads the newest checkpoint (``Trainer.roll_back``, as a
   resume does). Checkpoints are saved at sync points after this check, so the newest one precedes every flagged
   step; the weights it holds were trained only on steps before the spike;
2. adds the *data steps* (sample ranges of the original order: blocks of ``train.global_batch_size`` samples, or
   the ranges a batch-size ramp assigns; :func:`lmrecipe.data.order.data_step`) of the flagged steps to the guard's
   ``skipped_batches``. Optimizer step ``s``
   then reads the ``s``-th data step not skipped: the rolled-back steps between the checkpoint and the spike
   train on the same samples as before, the flagged ones' samples are replaced by the next unused ones, and the
   run still ends at ``train.max_steps``. The list is part of every later checkpoint, so a resume keeps skipping;
3. drops the ``metrics.jsonl`` rows after the checkpoint's step (one history, as after a resume);
4. appends a record to ``out_dir/spikes.jsonl`` (main process; one JSON object per rollback)::

       {"step": first flagged step (1-based), "detected_at_step": the sync point, "rolled_back_to": checkpoint step,
        "checkpoint": path, "rollback": n (1-based count over the run), "flagged": [{"step", "loss", "grad_norm",
        "window_loss_mean", "window_loss_std", "window_grad_norm_mean", "window_grad_norm_std", "loss_z",
        "reason"}, ...], "skipped": [{"step", "data_step", "samples": [first, end) global sample ids,
        "windows": window ids (one folder) or [source, window] pairs (a mixture), in sample order}, ...]}

More than ``spike.max_rollbacks`` rollbacks stop the run with exit code 2. A spike before the first checkpoint
cannot be rolled back: it is logged and recorded (``rolled_back_to`` null) and training goes on. The window of
recent losses, the skipped data steps and the rollback count are this feature's own state, saved in each checkpoint
(``extras.spikes`` of ``train_state.json``), so a resume judges steps exactly as the uninterrupted run would.
Tests inject a spike that follows the samples with ``LMRECIPE_FAULT_SPIKE_STEPS`` (``lmrecipe/train/callbacks/faults.py``).
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import torch

from lmrecipe.checkpoint.storage import complete_checkpoints, step_of_dir
from lmrecipe.config import SpikeConfig
from lmrecipe.data.order import data_step
from lmrecipe.fileio import write_text_atomic
from lmrecipe.train.callback import Callback, Stop

logger = logging.getLogger(__name__)

SPIKES_FILE = "spikes.jsonl"
_STD_FLOOR = 1e-3
"""The window's standard deviation is floored at this fraction of its mean."""
_FIELDS = ("flag", "loss", "grad_norm", "window_loss_mean", "window_grad_norm_mean", "window_loss_std",
           "window_grad_norm_std")


class SpikeDetector:
    """The rule of the module docstring, on the device. :meth:`observe` per step (no host read); :meth:`collect`
    at a sync point (one host read)."""

    def __init__(self, section: SpikeConfig, device: torch.device, grad_norm_must_be_finite: bool = True):
        self.section = section
        self.device = device
        self.grad_norm_must_be_finite = grad_norm_must_be_finite
        self.load(None)

    def load(self, window: list | None) -> None:
        """Start from a saved window (``[[loss, grad_norm], ...]``, oldest first; None values are missing) or empty."""
        rows = [[math.nan if v is None else float(v) for v in row] for row in (window or [])][-self.section.window:]
        buffer = torch.full((self.section.window, 2), math.nan, dtype=torch.float32)
        if rows:
            buffer[-len(rows):] = torch.tensor(rows, dtype=torch.float32)
        self.buffer = buffer.to(self.device)
        self._pending: list[torch.Tensor] = []
        self._steps: list[int] = []

    def observe(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor | float) -> None:
        """Judge step ``step`` (1-based) by its loss and gradient norm, both device scalars; no host read."""
        section = self.section
        x = torch.stack([loss.detach().float().reshape(()).to(self.device),
                         torch.as_tensor(grad_norm).detach().float().reshape(()).to(self.device)])
        finite = torch.isfinite(x)
        count = (~torch.isnan(self.buffer)).sum(0)
        mean = torch.nansum(self.buffer, 0) / count.clamp_min(1)
        var = torch.nansum((self.buffer - mean) ** 2, 0) / (count - 1).clamp_min(1)
        std = var.sqrt().clamp_min(_STD_FLOOR * mean.abs() + 1e-12)
        z = (x - mean) / std
        enough = count >= section.min_history
        flag = ~finite[0] | (enough[0] & (z[0] > section.z_threshold))
        if self.grad_norm_must_be_finite:
            flag = flag | ~finite[1]
        if section.grad_norm_z_threshold is not None:
            flag = flag | (enough[1] & (z[1] > section.grad_norm_z_threshold))
        pushed = torch.cat([self.buffer[1:], torch.where(finite, x, torch.nan)[None]])
        self.buffer = torch.where(flag, self.buffer, pushed)
        self._pending.append(torch.cat([flag.float()[None], x, mean, std]))
        self._steps.append(step)

    def collect(self, reduce_max=None) -> tuple[list[dict], list]:
        """The flagged steps since the last call (with their values and window statistics) and the current window.

        ``reduce_max``: makes a tensor the element-wise maximum over ranks (several processes), so all agree.
        """
        n = len(self._pending)
        packed = torch.cat([torch.stack(self._pending).flatten() if n else self.buffer.new_zeros(0),
                            self.buffer.flatten()])
        if reduce_max is not None:
            packed = reduce_max(packed)
        values = packed.tolist()
        rows = [dict(zip(_FIELDS, values[i * len(_FIELDS):(i + 1) * len(_FIELDS)])) for i in range(n)]
        flagged = []
        for step, row in zip(self._steps, rows):
            if row.pop("flag") > 0:
                flagged.append({"step": step, **row, "loss_z": _z(row), "reason": _reason(row)})
        window = [[None if math.isnan(v) else v for v in values[n * len(_FIELDS) + 2 * i: n * len(_FIELDS) + 2 * i + 2]]
                  for i in range(self.section.window)]
        self._pending, self._steps = [], []
        return flagged, [row for row in window if row[0] is not None]


def _z(row: dict) -> float | None:
    mean, std = row["window_loss_mean"], row["window_loss_std"]
    return (row["loss"] - mean) / std if math.isfinite(row["loss"]) and std > 0 else None


def _reason(row: dict) -> str:
    if not math.isfinite(row["loss"]):
        return "loss not finite"
    if not math.isfinite(row["grad_norm"]):
        return "gradient norm not finite"
    return "z-score above the threshold"


class SpikeGuard(Callback):
    """Detection and rollback for the trainer: :meth:`after_step` judges each step, :meth:`at_sync` rolls the run
    back (:meth:`Trainer.roll_back`) to the checkpoint before a spike.

    Owns its state (the rule's window as of the last sync, the data steps skipped for good, the rollback count;
    :meth:`state_dict`), and keeps the data order in step with the skipped data steps, also with
    ``spike.enabled=false`` (a resumed run keeps skipping what an earlier session rolled back).
    """

    name = "spikes"
    follows = ("Checkpointing",)  # a rollback goes back to a checkpoint the resume put in place

    def __init__(self, section: SpikeConfig):
        self.section = section
        self.window: list | None = None
        """The rule's window of recent steps' ``[loss, grad_norm]`` as of the last sync point."""
        self.skipped_batches: list[int] = []
        """Data steps (sample ranges of the original order, see the module docstring) never trained on, because
        a loss spike was rolled back; ascending. Step s reads the s-th data step not listed."""
        self.rollbacks = 0
        """Rollbacks after loss spikes over the run."""

    def attach(self, trainer) -> None:
        run = trainer.run
        self.accelerator = run.accelerator
        self.out_dir = trainer.out_dir
        self.batches, self.prefetcher = run.train_batches, run.prefetcher
        self.checkpoint_every_steps = run.cfg.checkpoint.every_steps
        self.detector = SpikeDetector(self.section, self.accelerator.device,
                                      grad_norm_must_be_finite=run.runtime.precision != "fp16")

    def on_start(self, trainer) -> None:
        if self.section.enabled and self.checkpoint_every_steps == 0:
            logger.warning("spike.enabled=true with checkpoint.every_steps=0: no checkpoint precedes a spike, so spikes "
                           "are recorded in %s but cannot be rolled back.", SPIKES_FILE)

    def state_dict(self) -> dict:
        return {"spike_window": self.window, "skipped_batches": list(self.skipped_batches), "rollbacks": self.rollbacks}

    def load_state_dict(self, state: dict | None) -> None:
        """Take a resumed (or reloaded) checkpoint's window, skipped data steps and rollback count."""
        state = state or {}
        self.window = state.get("spike_window")
        self.skipped_batches = list(state.get("skipped_batches") or [])
        self.rollbacks = int(state.get("rollbacks") or 0)
        self._apply()

    def _apply(self) -> None:
        self.batches.skipped = tuple(self.skipped_batches)
        self.prefetcher.reset()
        self.detector.load(self.window)

    def outcome(self, trainer) -> dict:
        return {"rollbacks": self.rollbacks, "skipped_batches": len(self.skipped_batches)}

    def after_step(self, trainer, result) -> None:
        """Judge the optimizer step just run (``state.step``, 1-based), by its loss and gradient norm (device work only)."""
        if not self.section.enabled:
            return
        loss = result.loss
        if self.accelerator.num_processes > 1:
            loss = self.accelerator.reduce(loss.detach().float(), reduction="mean")
        self.detector.observe(trainer.state.step, loss, result.grad_norm)

    def at_sync(self, trainer, longest_skip_run: int) -> bool:
        """Read the flags since the last sync point; on a spike, roll the run back to the checkpoint before it and
        return True (all ranks alike)."""
        if not self.section.enabled:
            return False
        state, checkpointer = trainer.state, trainer.checkpointer
        flagged, self.window = self.detector.collect(self._reduce_max if self.accelerator.num_processes > 1 else None)
        if not flagged:
            return False
        checkpointer.wait()
        first = flagged[0]["step"]
        target = self._checkpoint_before(first, checkpointer)
        record = {"step": first, "detected_at_step": state.step, "rolled_back_to": None, "checkpoint": None,
                  "rollback": self.rollbacks, "flagged": flagged, "skipped": []}
        if target is None:
            logger.warning("Loss spike at step %d (%s) but no checkpoint precedes it: recorded in %s, not rolled back.",
                           first, flagged[0]["reason"], self.out_dir / SPIKES_FILE)
            self._append(record)
            return False
        if self.rollbacks >= self.section.max_rollbacks:
            self._append(record)
            trainer.end_early(Stop(
                f"Stopped at step {state.step}: a loss spike at step {first} ({flagged[0]['reason']}), after "
                f"{self.rollbacks} rollbacks already (spike.max_rollbacks={self.section.max_rollbacks}); see "
                f"{self.out_dir / SPIKES_FILE}. Try a lower optim.lr or a longer schedule.warmup_steps, check the data "
                "the records name, or raise spike.max_rollbacks; then resume from the last checkpoint "
                "(checkpoint.resume=auto).", error=True))
        positions = [data_step(row["step"] - 1, self.skipped_batches) for row in flagged]
        record["skipped"] = [{"step": row["step"], "data_step": d, "samples": list(self.batches.ramp.range(d)),
                              "windows": self.batches.data_step_samples(d)} for row, d in zip(flagged, positions)]
        kept = (sorted(set(self.skipped_batches) | set(positions)), self.rollbacks + 1)
        trainer.roll_back(target)  # also reloads this guard's state as the checkpoint saved it
        # This run's skips and rollback count, not the checkpoint's; the window is the checkpoint's.
        self.skipped_batches, self.rollbacks = kept
        self._apply()
        record.update(rolled_back_to=state.step, checkpoint=str(target), rollback=self.rollbacks)
        self._append(record)
        logger.warning("Loss spike at step %d (%s, loss %.4g): rolled back to %s (step %d); the samples of %d step(s) "
                       "are skipped from now on (%s).", first, flagged[0]["reason"], flagged[0]["loss"], target,
                       state.step, len(positions), self.out_dir / SPIKES_FILE)
        return True

    def _checkpoint_before(self, step: int, checkpointer) -> Path | None:
        """The newest published checkpoint whose weights predate step ``step`` (1-based)."""
        latest = checkpointer.latest
        if latest is not None and step_of_dir(latest.name) < step:
            return latest
        earlier = [c.path for c in complete_checkpoints(checkpointer.root) if c.step < step]
        return earlier[-1] if earlier else None

    def _reduce_max(self, tensor: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return tensor

    def _append(self, record: dict) -> None:
        if not self.accelerator.is_main_process:
            return
        path = self.out_dir / SPIKES_FILE
        before = path.read_text() if path.is_file() else ""
        write_text_atomic(path, before + json.dumps(record) + "\n", durable=True)


def read_spikes(out_dir: str | Path) -> list[dict]:
    path = Path(out_dir) / SPIKES_FILE
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
