"""The weight EMA's files in a checkpoint and their reader (export and eval read them without a live run).

``ema.safetensors`` (full tensors by parameter name, written by the main process) or, under ZeRO-3,
``ema/rank_NNNNN.safetensors`` (each rank's partition of every parameter, with the full shapes in the metadata);
the update count is stored under :data:`COUNT_KEY`. See ``lmrecipe/train/callbacks/ema.py`` for the average itself.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from lmrecipe.errors import fail

logger = logging.getLogger(__name__)

FULL_FILE = "ema.safetensors"
PARTITION_DIR = "ema"
COUNT_KEY = "__num_updates__"
FORMAT = "lmrecipe-ema-1"
def partition_file(rank: int) -> str:
    return f"{PARTITION_DIR}/rank_{rank:05d}.safetensors"


class SavedEMA:
    """The average in a checkpoint, read by parameter name as full tensors from either layout (a context manager).

    ZeRO-3 partitions are consolidated per tensor: its partitions in rank order, concatenated and cut to its size
    (the last partition is padded).
    """

    def __init__(self, ckpt: Path):
        from safetensors import safe_open

        self.ckpt = ckpt
        if (ckpt / FULL_FILE).is_file():
            self.handles = [safe_open(ckpt / FULL_FILE, framework="pt")]
            self.shapes = {k: None for k in self.handles[0].keys() if k != COUNT_KEY}
        else:
            files = sorted((ckpt / PARTITION_DIR).glob("rank_*.safetensors")) if (ckpt / PARTITION_DIR).is_dir() else []
            if not files:
                raise fail(f"{ckpt} holds no weight EMA ({FULL_FILE} or {PARTITION_DIR}/): the run trained with "
                           "train.ema_decay=0. Export its trained weights instead (--weights raw), or train with "
                           "train.ema_decay>0.")
            self.handles = [safe_open(f, framework="pt") for f in files]
            meta = self.handles[0].metadata()
            if int(meta["world_size"]) != len(files):
                raise fail(f"{ckpt / PARTITION_DIR} holds {len(files)} partition files but the run had "
                           f"{meta['world_size']} processes: the checkpoint is incomplete.")
            self.shapes = {name: shape for name, shape in json.loads(meta["shapes"]).items()}
        self.num_updates = self.handles[0].get_tensor(COUNT_KEY)

    def __enter__(self) -> "SavedEMA":
        return self

    def __exit__(self, *exc) -> None:
        self.handles = []

    def full(self, name: str) -> torch.Tensor:
        shape = self.shapes[name]
        if shape is None:
            return self.handles[0].get_tensor(name)
        numel = 1
        for size in shape:
            numel *= size
        return torch.cat([h.get_tensor(name).reshape(-1) for h in self.handles])[:numel].reshape(shape)


def has_ema(ckpt: Path) -> bool:
    return (ckpt / FULL_FILE).is_file() or (ckpt / PARTITION_DIR).is_dir()


def read_ema_state_dict(ckpt: Path, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The averaged weights of checkpoint ``ckpt`` as full tensors by parameter name, in ``dtype``.

    UserError if the checkpoint holds no average.
    """
    with SavedEMA(ckpt) as saved:
        return {name: saved.full(name).to(dtype, copy=True) for name in saved.shapes}
