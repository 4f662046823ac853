"""Fused kernels for the model's elementwise work (``model.kernels``): ``liger`` swaps Liger-Kernel's Triton RMSNorm,
SwiGLU and rotary kernels into a built model; ``none`` keeps transformers' own modules.

Liger's loss kernels stay off (``cross_entropy``, ``fused_linear_cross_entropy``): the loss head is
``lmrecipe/model/loss.py``'s. Its rotary kernel takes per-row positions, so document masking's restarting
``position_ids`` keep working. :func:`check_kernels` runs at start-up (``lmrecipe/train/preflight.py``) beside the
attention kernel's check; :func:`maybe_apply_kernels` patches a built model in place, which cannot be undone.
"""

from __future__ import annotations

import importlib.util
import inspect

import torch
from torch import nn

from lmrecipe.errors import fail

_FIX = ("install it (pip install 'lmrecipe[liger]', or pip install liger-kernel) on a GPU machine, or set "
        "model.kernels=none (transformers' own modules, any device)")
_WANTED = {"rope": True, "rms_norm": True, "swiglu": True, "cross_entropy": False, "fused_linear_cross_entropy": False}
"""The keywords every ``apply_liger_kernel_to_*`` is called with (those it accepts)."""


def check_kernels(kernels: str) -> None:
    """UserError naming the fix when ``model.kernels=liger`` cannot run here: no CUDA GPU, no Triton, or no
    ``liger-kernel`` package (each that is missing named, in one message)."""
    if kernels != "liger":
        return
    missing = [what for what, ok in (("a CUDA GPU", torch.cuda.is_available()),
                                     ("Triton (the triton package)", _installed("triton")),
                                     ("the liger-kernel package (module liger_kernel)", _installed("liger_kernel")))
               if not ok]
    if missing:
        raise fail(f"model.kernels=liger runs Liger-Kernel's Triton kernels, which need a CUDA GPU, Triton and the "
                   f"liger-kernel package; this machine lacks {' and '.join(missing)}: {_FIX}.")


def check_kernel_arch(kernels: str, hf_config) -> None:
    """UserError when Liger-Kernel has no kernels for the model's architecture (``hf_config.model_type``)."""
    if kernels == "liger" and liger_apply_fn(hf_config.model_type) is None:
        raise fail(f"model.kernels=liger: Liger-Kernel has no kernels for the architecture {hf_config.model_type!r} "
                   f"(it has: {', '.join(sorted(_liger_table()))}). Set model.kernels=none.")


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _liger_table() -> dict:
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    return MODEL_TYPE_TO_APPLY_LIGER_FN


def liger_apply_fn(model_type: str):
    """Liger's ``apply_liger_kernel_to_<arch>`` for a transformers ``model_type``, or None."""
    return _liger_table().get(model_type)


def maybe_apply_kernels(model: nn.Module, kernels: str) -> list[str]:
    """Patch the model instance (the bare model, not an engine) with the kernels of ``model.kernels``; returns the
    keywords that were turned on (none for ``none``)."""
    if kernels != "liger":
        return []
    apply = liger_apply_fn(model.config.model_type)
    accepted = inspect.signature(apply).parameters
    kwargs = {key: value for key, value in _WANTED.items() if key in accepted}
    apply(model=model, **kwargs)
    return [key for key, value in kwargs.items() if value]
