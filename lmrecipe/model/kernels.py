"""Fused kernels for the model's elementwise work (``model.kernels``): ``liger`` swaps Liger-Kernel's Triton RMSNorm,
SwiGLU and rotary kernels into a built model; ``none`` keeps transformers' own modules; ``auto`` (the default) is
``liger`` where it can run (:func:`resolve_kernels`), else ``none``.

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
        "model.kernels=auto (Liger where it can run, else none) or model.kernels=none (transformers' own modules)")
_WANTED = {"rope": True, "rms_norm": True, "swiglu": True, "cross_entropy": False, "fused_linear_cross_entropy": False}
"""The keywords every ``apply_liger_kernel_to_*`` is called with (those it accepts)."""


def liger_missing() -> list[str]:
    """What this machine lacks for Liger-Kernel's Triton kernels ([] when it has a CUDA GPU, Triton and the package)."""
    return [what for what, ok in (("a CUDA GPU", torch.cuda.is_available()),
                                  ("Triton (the triton package)", _installed("triton")),
                                  ("the liger-kernel package (module liger_kernel)", _installed("liger_kernel")))
            if not ok]


def resolve_kernels(kernels: str, model_type: str, moe: bool = False) -> str:
    """``model.kernels`` as the run applies it: ``auto`` is ``liger`` where this machine can run Liger-Kernel and it
    has kernels for ``model_type`` (a transformers ``model_type``) of a dense model, else ``none``; the other values
    as they are. A mixture of experts (``moe``) stays ``none``: Liger was measured on the dense 1B recipe only."""
    if kernels != "auto":
        return kernels
    return "liger" if not moe and not liger_missing() and liger_apply_fn(model_type) is not None else "none"


def check_kernels(kernels: str) -> None:
    """UserError naming the fix when ``model.kernels=liger`` cannot run here: no CUDA GPU, no Triton, or no
    ``liger-kernel`` package (each that is missing named, in one message)."""
    if kernels != "liger":
        return
    if missing := liger_missing():
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


def maybe_apply_kernels(model: nn.Module, kernels: str, moe: bool = False) -> list[str]:
    """Patch the model instance (the bare model, not an engine) with the kernels of ``model.kernels`` (``auto``
    resolved by :func:`resolve_kernels`); returns the keywords that were turned on (none for ``none``)."""
    if resolve_kernels(kernels, model.config.model_type, moe) != "liger":
        return []
    apply = liger_apply_fn(model.config.model_type)
    accepted = inspect.signature(apply).parameters
    kwargs = {key: value for key, value in _WANTED.items() if key in accepted}
    apply(model=model, **kwargs)
    return [key for key, value in kwargs.items() if value]
