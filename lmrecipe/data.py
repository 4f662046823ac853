"""Memory-mapped token windows and the deterministic order in which training reads them.

The samples of optimizer step ``s`` are samples ``[s*G, (s+1)*G)`` of a permutation of window indices
seeded by ``(seed, epoch)``; they are split into accumulation micro-steps and ranks by position only.
So what a step trains on does not depend on how G is split (processes x micro-batch x accumulation),
and resuming at step ``s`` needs no skipping.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .config import TrainConfig
from .errors import fail

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
"""Version of the prepared-data folder format (``meta.json`` ``format_version``) that this code reads and writes."""
SPLITS = ("train", "val")
_META_KEYS = ("format_version", "tokenizer", "vocab_size", "eos_id", "dtype", "source", "splits")
_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
# Scanning for out-of-range ids reads the file in chunks so memory stays flat on large datasets.
_SCAN_CHUNK_TOKENS = 1 << 26


def read_meta(data_dir: str | os.PathLike) -> dict[str, Any]:
    """Load and check ``meta.json`` of a folder written by ``tools/prepare_data.py``; UserError if it is not one."""
    data_dir = Path(data_dir)
    path = data_dir / "meta.json"
    remedy = f"Create it with `python tools/prepare_data.py --output {data_dir}` (add --overwrite to replace it)."
    if not path.is_file():
        raise fail(f"{path} not found: {data_dir} is not a prepared data folder. {remedy}")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise fail(f"{path} is not readable JSON ({err}). {remedy}") from err
    if not isinstance(meta, dict):
        raise fail(f"{path} must hold a JSON object, found {type(meta).__name__}. {remedy}")
    missing = [key for key in _META_KEYS if key not in meta]
    if missing:
        raise fail(f"{path} lacks {', '.join(missing)}. {remedy}")
    if meta["format_version"] != FORMAT_VERSION:
        raise fail(f"{path} has format_version {meta['format_version']!r}; this code reads {FORMAT_VERSION}. {remedy}")
    if meta["dtype"] not in ("uint16", "uint32"):
        raise fail(f"{path} has dtype {meta['dtype']!r}; expected uint16 or uint32. {remedy}")
    splits = meta["splits"]
    if not isinstance(splits, dict) or any(not isinstance(splits.get(s), dict) or "n_tokens" not in splits[s]
                                           for s in SPLITS):
        raise fail(f"{path} must describe splits train and val, each with n_tokens. {remedy}")
    return meta


def load_meta(data_dir: str | Path) -> dict:
    """Read ``meta.json`` (schema checked by read_meta) and check it against the .bin files."""
    data_dir = Path(data_dir)
    how_to_make = f"Create it with: python tools/prepare_data.py --output {data_dir}"
    if not data_dir.is_dir():
        raise fail(f"Data folder {str(data_dir)!r} does not exist. {how_to_make}")
    if not any(data_dir.iterdir()):
        raise fail(f"Data folder {str(data_dir)!r} is empty. {how_to_make}")
    meta = read_meta(data_dir)
    dtype = np.dtype(_DTYPES[meta["dtype"]])
    for name in SPLITS:
        path = data_dir / f"{name}.bin"
        n_tokens = int(meta["splits"][name]["n_tokens"])
        if not path.is_file():
            raise fail(f"{path} is missing although meta.json lists it. Re-create the folder. {how_to_make}")
        expected = n_tokens * dtype.itemsize
        actual = path.stat().st_size
        if actual != expected:
            raise fail(
                f"{path} holds {actual} bytes but meta.json says {n_tokens} {meta['dtype']} tokens "
                f"({expected} bytes): the file is truncated or from another preparation. Re-create the folder. {how_to_make}"
            )
    return meta


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 24), b""):
            digest.update(chunk)
    return digest.hexdigest()


class TokenWindows:
    """Windows of ``seq_len + 1`` tokens over one split's memmap (window i starts at token i*seq_len)."""

    def __init__(self, data_dir: str | Path, split: str, seq_len: int, meta: dict | None = None):
        meta = meta if meta is not None else load_meta(data_dir)
        self.path = Path(data_dir) / f"{split}.bin"
        self.seq_len = seq_len
        # mode="r" maps the file read-only: pages are read on demand, never copied whole into memory.
        self.tokens = np.memmap(self.path, dtype=_DTYPES[meta["dtype"]], mode="r")
        self.n_windows = (len(self.tokens) - 1) // seq_len
        if self.n_windows < 1:
            raise fail(
                f"data.seq_len={seq_len} is longer than the {split} split ({len(self.tokens)} tokens in {self.path}); "
                f"a window needs seq_len + 1 tokens. Lower data.seq_len or prepare more data."
            )

    def __len__(self) -> int:
        return self.n_windows

    def batch(self, window_ids: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets, both ``[len(window_ids), seq_len]`` int64."""
        L = self.seq_len
        rows = np.stack([self.tokens[i * L : i * L + L + 1] for i in window_ids]).astype(np.int64)
        return torch.from_numpy(rows[:, :-1]), torch.from_numpy(rows[:, 1:])

    def max_token_id(self) -> int:
        return max(int(self.tokens[i : i + _SCAN_CHUNK_TOKENS].max()) for i in range(0, len(self.tokens), _SCAN_CHUNK_TOKENS))


class SampleOrder:
    """Global sample index -> window index: a permutation per epoch, seeded by (seed, epoch)."""

    def __init__(self, n_windows: int, seed: int):
        self.n_windows = n_windows
        self.seed = seed

    @lru_cache(maxsize=2)
    def permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.n_windows)

    def windows(self, first_sample: int, count: int) -> np.ndarray:
        samples = np.arange(first_sample, first_sample + count)
        epochs, positions = np.divmod(samples, self.n_windows)
        return np.array([self.permutation(int(e))[p] for e, p in zip(epochs, positions)], dtype=np.int64)


@dataclass(frozen=True)
class BatchLayout:
    """How one optimizer step's G sequences are split: G = micro_batch_size x world_size x accum_steps.

    The one place the accumulation steps are derived; the Accelerator, DeepSpeed's config, the loader and the
    logs all read them from here. Construction fails with a UserError if G does not split evenly.
    """

    global_batch_size: int
    micro_batch_size: int
    world_size: int
    rank: int

    def __post_init__(self):
        per_step = self.micro_batch_size * self.world_size
        if self.global_batch_size % per_step:
            raise fail(
                f"train.global_batch_size={self.global_batch_size} is not a multiple of "
                f"train.micro_batch_size={self.micro_batch_size} x {self.world_size} processes = {per_step}. "
                "Change one of them so the global batch splits evenly over processes."
            )

    @classmethod
    def from_config(cls, train: TrainConfig, world_size: int, rank: int = 0) -> "BatchLayout":
        return cls(train.global_batch_size, train.micro_batch_size, world_size, rank)

    @property
    def accum_steps(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.world_size)

    def first_sample(self, step: int, micro_step: int) -> int:
        """Global sample index of this rank's first sequence in micro-step ``micro_step`` of ``step``."""
        offset = (micro_step * self.world_size + self.rank) * self.micro_batch_size
        return step * self.global_batch_size + offset


class TrainBatches:
    """The micro-batches each rank trains on at each optimizer step."""

    def __init__(self, windows: TokenWindows, layout: BatchLayout, seed: int):
        self.windows = windows
        self.layout = layout
        self.order = SampleOrder(len(windows), seed)

    def window_ids(self, step: int, micro_step: int) -> np.ndarray:
        return self.order.windows(self.layout.first_sample(step, micro_step), self.layout.micro_batch_size)

    def micro_batches(self, step: int):
        """Yield ``(inputs, targets)`` for each accumulation micro-step of ``step`` on this rank."""
        for micro_step in range(self.layout.accum_steps):
            yield self.windows.batch(self.window_ids(step, micro_step))

    def epoch_of(self, step: int) -> float:
        return step * self.layout.global_batch_size / len(self.windows)


class Prefetcher:
    """Assembles the micro-batches of step ``s + 1`` on a background thread while step ``s`` computes.

    The batches are exactly ``batches.micro_batches(step)`` (same order, same resume behaviour); only where
    they are built changes. With ``pin_memory`` (CUDA) they land in page-locked memory, so the copy to the
    device with ``non_blocking=True`` is asynchronous (from pageable memory it is synchronous). Memory-map
    reads and the numpy/torch copies release the GIL, so the thread overlaps with the training step.
    """

    def __init__(self, batches: TrainBatches, pin_memory: bool = False):
        from concurrent.futures import ThreadPoolExecutor

        self.batches = batches
        self.pin_memory = pin_memory
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefetch")
        self._next: tuple[int, object] | None = None

    def _load(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        loaded = list(self.batches.micro_batches(step))
        if self.pin_memory:
            loaded = [(inputs.pin_memory(), targets.pin_memory()) for inputs, targets in loaded]
        return loaded

    def get(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The micro-batches of ``step``; starts assembling those of ``step + 1``."""
        if self._next is not None and self._next[0] == step:
            loaded = self._next[1].result()
        else:  # the first step, or a jump (resume): load in this thread
            loaded = self._load(step)
        self._next = (step + 1, self._executor.submit(self._load, step + 1))
        return loaded

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
        self._next = None


class ValBatches:
    """A fixed set of validation windows spread over val.bin, the same on every run and rank split.

    Each rank takes a stride of the set, padded so every rank runs the same number of forward passes
    (ZeRO-3 gathers parameters collectively in forward); padded rows carry weight 0.
    """

    def __init__(self, windows: TokenWindows, n_windows: int, micro_batch_size: int, world_size: int, rank: int):
        count = min(n_windows, len(windows))
        self.all_ids = np.unique(np.linspace(0, len(windows) - 1, num=count).round().astype(np.int64))
        self.windows = windows
        self.micro_batch_size = micro_batch_size
        per_rank = -(-len(self.all_ids) // world_size)
        ids = self.all_ids[rank::world_size]
        self.valid = np.zeros(per_rank, dtype=np.float64)
        self.valid[: len(ids)] = 1.0
        self.rank_ids = np.concatenate([ids, np.full(per_rank - len(ids), self.all_ids[0], dtype=np.int64)])

    def __iter__(self):
        """Yield ``(inputs, targets, valid)`` with ``valid`` 1.0 for real rows and 0.0 for padding."""
        for i in range(0, len(self.rank_ids), self.micro_batch_size):
            inputs, targets = self.windows.batch(self.rank_ids[i : i + self.micro_batch_size])
            yield inputs, targets, torch.from_numpy(self.valid[i : i + self.micro_batch_size])


def open_data(data_dir: str | Path, seq_len: int, model_vocab_size: int | None) -> tuple[dict, TokenWindows, TokenWindows]:
    """Open both splits with the start-up checks: meta vs files, seq_len vs split sizes, ids vs vocab."""
    meta = load_meta(data_dir)
    train = TokenWindows(data_dir, "train", seq_len, meta)
    val = TokenWindows(data_dir, "val", seq_len, meta)
    if model_vocab_size is not None:
        if int(meta["vocab_size"]) > model_vocab_size:
            raise fail(
                f"The data's tokenizer has vocab_size={meta['vocab_size']} but the model's vocab size is "
                f"{model_vocab_size}: token ids would index past the embedding. Set model.vocab_size >= "
                f"{meta['vocab_size']} (or null to take it from the data)."
            )
        for split in (train, val):
            top = split.max_token_id()
            if top >= model_vocab_size:
                raise fail(
                    f"{split.path} contains token id {top}, which is >= the model's vocab size {model_vocab_size}. "
                    f"Set model.vocab_size above {top} or re-prepare the data with the model's tokenizer."
                )
    return meta, train, val
