"""Every rank's RNG streams in a checkpoint: ``rng/rank_NNNNN.safetensors`` (torch CPU and CUDA, numpy, ``random``).

Each rank saves its own streams as tensors plus string metadata (no pickle) and a resume restores them exactly.
RNG state is per rank and cannot be split or merged: a rank beyond the saving run's process count keeps the fresh
streams it was seeded with (``train.seed``). The default model draws no random numbers while training (no dropout;
the sample order is a function of the step), so losses do not depend on it.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path

import numpy as np
import torch

from lmrecipe.checkpoint.storage import RNG_DIR

logger = logging.getLogger(__name__)


def rng_file(checkpoint: Path, rank: int) -> Path:
    return checkpoint / RNG_DIR / f"rank_{rank:05d}.safetensors"


def save_rng(checkpoint: Path, rank: int) -> None:
    """Write this process's RNG streams as rank ``rank``'s file of ``checkpoint`` (its ``rng/`` folder exists)."""
    from safetensors.torch import save_file

    tensors, metadata = rng_state_tensors()
    save_file(tensors, rng_file(checkpoint, rank), metadata=metadata)


def restore_rng(checkpoint: Path, rank: int, saved_world_size: int) -> None:
    """Set this process's RNG streams from rank ``rank``'s file of ``checkpoint``, saved by a run of
    ``saved_world_size`` processes; a rank without a file keeps its streams (and the log says so)."""
    from safetensors import safe_open

    path = rng_file(checkpoint, rank)
    if rank >= saved_world_size or not path.is_file():
        logger.info("%s holds no RNG state for rank %d (saved with %d processes); it starts fresh streams "
                    "(seeded by train.seed).", checkpoint, rank, saved_world_size)
        return
    with safe_open(path, framework="pt") as fh:
        set_rng_state({k: fh.get_tensor(k) for k in fh.keys()}, fh.metadata())


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
