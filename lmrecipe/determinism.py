"""Determinism mode (``train.deterministic=true``): the same recipe gives the same losses and weights, bit for bit.

What it sets, before the Accelerator and the model exist:

- ``torch.use_deterministic_algorithms(True)``: an op without a deterministic kernel raises instead of running a
  non-deterministic one (on GPUs: atomics-based scatter/index_add backward, some cuDNN convolutions, ...);
- ``CUBLAS_WORKSPACE_CONFIG=:4096:8``, which cuBLAS needs for reproducible matmuls (CUDA >= 10.2), and
  cuDNN's deterministic mode without its autotuner;
- the seeds of ``random``, numpy and torch (every device) from ``train.seed``.

What it cannot give: bitwise equality across different hardware, thread counts, library versions or numbers of
processes; the order in which NCCL and DeepSpeed reduce gradient buckets (a floating-point sum depends on it);
kernels that have no deterministic variant (the run stops with torch's error naming the op); and flash
attention's backward on some GPUs. It costs speed, so it is a debugging mode, off by default.
"""

from __future__ import annotations

import logging
import os
import random

import numpy as np
import torch

logger = logging.getLogger(__name__)

CUBLAS_WORKSPACE = ":4096:8"


def maybe_set_deterministic(enabled: bool, seed: int) -> None:
    """Turn determinism mode on (a no-op when ``enabled`` is false). Call before CUDA is first used."""
    if not enabled:
        return
    previous = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if previous not in (None, CUBLAS_WORKSPACE, ":16:8"):
        logger.warning("CUBLAS_WORKSPACE_CONFIG=%s is not a deterministic setting; using %s", previous, CUBLAS_WORKSPACE)
    if previous not in (CUBLAS_WORKSPACE, ":16:8"):
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # seeds every CUDA device too
    logger.info("Deterministic mode: deterministic algorithms, CUBLAS_WORKSPACE_CONFIG=%s, seed %d",
                os.environ["CUBLAS_WORKSPACE_CONFIG"], seed)
