"""Weight EMA: an exponential moving average of the weights, kept in fp32 beside training.

``train.ema_decay = d`` (0 = off). After every applied optimizer step ``k`` (1, 2, ...; skipped updates do not
count) the average moves towards the weights ``w_k``::

    ema_k = ema_{k-1} + (w_k - ema_{k-1}) * (1 - d) / (1 - d**k)

which is the bias-corrected EMA (Adam's correction, stored already divided): ``ema_k`` equals
``sum_i (1 - d) d**(k-i) w_i / (1 - d**k)`` exactly, a normalised average of the weights after updates 1..k with
no share left to the random initialisation (a plain EMA started from the initial weights would keep ``d**k`` of
them: 37 % after 1,000 steps at d = 0.999). The first update copies the weights; for large ``k`` it is the plain
EMA of decay ``d``, an average over about ``1 / (1 - d)`` steps.

What each rank holds (this rank's "owned" weights):

- without DeepSpeed and under ZeRO-1/2 every rank holds the full weights, so the shadow is full on every rank
  (4 bytes per parameter); the ranks' copies are identical and the main process saves one;
- under ZeRO-3 each rank holds its partition of every parameter (``param.ds_tensor``) and averages that only
  (4 bytes per parameter / processes); the checkpoint keeps the partitions, consolidated offline on export.

The average is taken of the weights the model computes with (the 16-bit copies under bf16 DeepSpeed, fp32
otherwise). The update is device-side: no value is read on the host, and a skipped step (non-finite gradients,
a device flag) gives the update a weight of 0 and does not advance ``k``.

Checkpoint files (in the checkpoint folder, listed in its manifest)::

    ema.safetensors                 full tensors by parameter name (no DeepSpeed, ZeRO-1/2); written by the main process
    ema/rank_NNNNN.safetensors      ZeRO-3: this rank's flat partition of each parameter, by name; the full shapes
                                    are in the metadata

Both hold ``__num_updates__`` (``k``) and the decay in their metadata. :func:`read_ema_state_dict` returns the
full tensors by name from either layout, for the export.
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path
from typing import Iterator

import torch

from lmrecipe.checkpoint.ema_files import COUNT_KEY, FORMAT, FULL_FILE, SavedEMA, has_ema, partition_file
from lmrecipe.config import TrainConfig
from lmrecipe.errors import fail
from lmrecipe.model.build import bare_parameter_name
from lmrecipe.train.callback import Callback

logger = logging.getLogger(__name__)

class WeightEMA(Callback):
    """``train.ema_decay`` for the trainer: the :class:`WeightAverage` of the run's model, updated after every step;
    the averaged weights' validation loss added to every evaluation (``val_loss_ema``), measured first, so the trained
    weights' loss is measured after they were swapped back (a faulty restore would show as a difference from the
    checkpoint's weights); the average in every checkpoint (:meth:`save_files`)."""

    name = "ema"

    def __init__(self, section: TrainConfig):
        self.decay = section.ema_decay
        self.average: WeightAverage | None = None
        self.last_val_loss: float | None = None
        """The averaged weights' validation loss at the latest evaluation (saved with the callback's state)."""

    def attach(self, trainer) -> None:
        run = trainer.run
        acc = run.accelerator
        self.average = WeightAverage(run.model, self.decay, zero3=run.runtime.topology.zero.stage == 3,
                                     rank=acc.process_index, world_size=acc.num_processes,
                                     is_main=acc.is_main_process, device=acc.device)

    def after_step(self, trainer, result) -> None:
        self.average.update(result.skipped)

    def eval_figures(self, trainer, evaluate) -> dict[str, float]:
        with self.average.swapped_in():
            self.last_val_loss = evaluate()
        return {"val_loss_ema": self.last_val_loss}

    def outcome(self, trainer) -> dict:
        return {"last_val_loss_ema": self.last_val_loss}

    def state_dict(self) -> dict:
        return {"last_val_loss_ema": self.last_val_loss}

    def load_state_dict(self, state: dict | None) -> None:
        self.last_val_loss = None if state is None else state.get("last_val_loss_ema")

    def save_files(self, folder: Path) -> None:
        self.average.save_files(folder)

    def load_files(self, folder: Path) -> bool:
        return self.average.load_files(folder)


class WeightAverage:
    """The fp32 moving average of the weights this rank owns; see the module docstring. Every method runs on every
    rank (the ZeRO-3 swap re-gathers persistent parameters collectively)."""

    def __init__(self, model: torch.nn.Module, decay: float, *, zero3: bool, rank: int = 0, world_size: int = 1,
                 is_main: bool = True, device: torch.device | str | None = None):
        """
        Args:
            model: the prepared model (DDP wrapper, DeepSpeed engine or the module itself).
            decay: ``train.ema_decay``, in (0, 1).
            zero3: parameters are ZeRO-3 partitioned (average ``param.ds_tensor``, this rank's partition).
            device: where the update counter lives (the accelerator's device).
        """
        if not 0.0 < decay < 1.0:
            raise ValueError(f"EMA decay must be in (0, 1), got {decay}")
        self.decay = decay
        self.zero3 = zero3
        self.rank, self.world_size, self.is_main = rank, world_size, is_main
        self.names: list[str] = []
        self.params: list[torch.nn.Parameter] = []
        for name, param in model.named_parameters():  # tied weights appear once
            self.names.append(bare_parameter_name(name))
            self.params.append(param)
        with torch.no_grad():
            self.shadow = [t.detach().float().clone() for t in self._owned()]
        first = self.shadow[0].device if self.shadow else torch.device("cpu")
        self.num_updates = torch.zeros((), dtype=torch.float64, device=device or first)
        """Applied updates ``k`` so far (a device tensor: counting skips on the host would be a sync)."""

    def _owned(self) -> list[torch.Tensor]:
        """This rank's weights: the ZeRO-3 partitions (fetched each time: DeepSpeed may move them), or the params."""
        if self.zero3:
            return [p.ds_tensor for p in self.params]
        return [p.detach() for p in self.params]

    @torch.no_grad()
    def update(self, skipped: torch.Tensor | bool = False) -> None:
        """Move the average towards the current weights, after an optimizer step; no host sync.

        ``skipped``: the step's update was skipped (a device flag or a bool); the average and ``k`` stay as they are.
        """
        applied = ~torch.as_tensor(skipped, device=self.num_updates.device).bool()
        self.num_updates += applied
        # where(): at k = 0 the unused branch divides by zero, harmlessly.
        weight = torch.where(applied, (1.0 - self.decay) / (1.0 - self.decay ** self.num_updates), 0.0).float()
        owned = self._owned()
        by_device: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        for i, tensor in enumerate(owned):
            by_device.setdefault((tensor.device, tensor.dtype), []).append(i)
        for (device, dtype), index in by_device.items():
            weight_here = weight.to(device, non_blocking=True)
            for i in index:
                # lerp_ per tensor: _foreach_lerp_ turns a tensor weight into a host scalar (a device sync).
                self.shadow[i].lerp_(owned[i] if dtype == torch.float32 else owned[i].float(), weight_here)

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """Within the block the model computes with the averaged weights; the trained ones are restored after, bit
        for bit (a copy of this rank's weights is held meanwhile)."""
        with torch.no_grad():
            owned = self._owned()
            trained = [t.clone() for t in owned]
            torch._foreach_copy_(owned, self.shadow)
            self._refresh_gathered()
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_(self._owned(), trained)
                self._refresh_gathered()

    def _refresh_gathered(self) -> None:
        """ZeRO-3: make gathered copies follow the partitions just written.

        Parameters still gathered (the persistent small ones, which DeepSpeed keeps whole on every rank) would keep
        the old values: release them, then gather the persistent ones again, as DeepSpeed does after a step.
        """
        if not self.zero3:
            return
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        gathered = [p for p in self.params if p.ds_status == ZeroParamStatus.AVAILABLE]
        if gathered:
            gathered[0].partition(gathered)
        persistent = [p for p in self.params if getattr(p, "ds_persist", False)]
        if persistent:
            persistent[0].all_gather(persistent)

    # ---- checkpoint files

    def save_files(self, folder: Path) -> None:
        """Write the average into checkpoint ``folder`` (every rank calls; see the module docstring for the files)."""
        from safetensors.torch import save_file

        metadata = {"format": FORMAT, "decay": repr(self.decay), "world_size": str(self.world_size)}
        count = self.num_updates.detach().cpu().reshape(1)
        if self.zero3:
            metadata.update(layout="zero3_partition", rank=str(self.rank),
                            shapes=json.dumps({n: list(p.ds_shape) for n, p in zip(self.names, self.params)}))
            tensors = {n: s.detach().cpu().contiguous() for n, s in zip(self.names, self.shadow)}
            path = folder / partition_file(self.rank)
            path.parent.mkdir(parents=True, exist_ok=True)
        elif self.is_main:
            metadata["layout"] = "full"
            tensors = {n: s.detach().cpu().reshape(p.shape).contiguous()
                       for n, s, p in zip(self.names, self.shadow, self.params)}
            path = folder / FULL_FILE
        else:
            return
        save_file({**tensors, COUNT_KEY: count}, path, metadata=metadata)

    def load_files(self, folder: Path) -> bool:
        """Restore the average saved in checkpoint ``folder``; False (and the average kept) if it holds none.

        The saved average is read by name as full tensors, so a checkpoint written on another process count or ZeRO
        stage loads too (each ZeRO-3 rank takes its partition of each tensor, one tensor at a time).
        """
        if not has_ema(folder):
            logger.warning("%s holds no weight EMA (trained with train.ema_decay=0): the average starts from the "
                           "resumed weights.", folder)
            return False
        with SavedEMA(folder) as saved:
            missing = sorted(set(self.names) - set(saved.shapes))
            if missing:
                raise fail(f"{folder} lacks the weight average of {missing[:5]}: it was written for another model.")
            with torch.no_grad():
                for name, shadow in zip(self.names, self.shadow):
                    flat = saved.full(name).reshape(-1)
                    if self.zero3:  # this rank's partition: ceil(numel / processes) values, the last one padded
                        flat = flat[self.rank * shadow.numel():(self.rank + 1) * shadow.numel()]
                        flat = torch.nn.functional.pad(flat, (0, shadow.numel() - flat.numel()))
                    elif flat.numel() != shadow.numel():
                        raise fail(f"{folder}: the average of {name} holds {flat.numel()} values where this model has "
                                   f"{shadow.numel()}; it was written for another model.")
                    shadow.copy_(flat.reshape(shadow.shape))
            self.num_updates.copy_(saved.num_updates.reshape(()))
        return True
