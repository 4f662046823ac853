"""The run's precision: ``train.precision`` resolved on this machine, and what fp8 needs (torchao's recipe)."""

from __future__ import annotations

import torch

from lmrecipe.errors import fail


def resolve_precision(requested: str) -> str:
    """auto = bf16 on GPUs that support it, fp16 on older GPUs, fp32 on CPUs (bf16 matmul is slower there)."""
    if requested != "auto":
        return requested
    if torch.cuda.is_available():
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return "fp32"


def check_precision(requested: str) -> str:
    """The precision ``train.precision`` resolves to on this machine; exit 2 where it cannot train here (fp16 without
    a GPU, fp8 without torchao or float8 tensor cores)."""
    precision = resolve_precision(requested)
    if precision == "fp16" and not torch.cuda.is_available():
        raise fail("train.precision=fp16 needs a GPU; use fp32 or bf16 on a CPU.")
    if precision == "fp8":
        check_fp8()
    return precision


def maybe_allow_tf32(deterministic: bool) -> bool:
    """On a CUDA GPU, let the fp32 matmuls and convolutions that remain under bf16/fp16 autocast (and every one of an
    fp32 run) use TF32 tensor cores; not in ``train.deterministic`` mode, which asks for full fp32. Returns whether
    it did."""
    if deterministic or not torch.cuda.is_available():
        return False
    torch.set_float32_matmul_precision("high")
    torch.backends.cudnn.allow_tf32 = True
    return True


def check_fp8() -> None:
    """What ``train.precision=fp8`` needs: torchao, and a GPU with float8 tensor cores (compute capability 8.9 or
    later: Ada, Hopper, Blackwell). Without a GPU, torchao emulates the float8 matmuls (for tests)."""
    try:
        import torchao.float8  # noqa: F401
    except ImportError as err:
        raise fail(f"train.precision=fp8 needs torchao ({err}): pip install torchao==0.18.0, or choose "
                   "train.precision=bf16.") from None
    if torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9):
        name = torch.cuda.get_device_name()
        raise fail(f"train.precision=fp8 needs float8 tensor cores (compute capability 8.9+: H100, H200, L40S, RTX "
                   f"4090); the {name} has {torch.cuda.get_device_capability()}. Use train.precision=bf16.")


def fp8_recipe():
    """Accelerate's torchao recipe. The float8 all-gather is off: ZeRO-2/3 fail to swap the weight for its float8
    subclass with it on ("Couldn't swap Float8Linear.weight"), and DeepSpeed gathers bf16 weights anyway. Which
    layers convert is set per model before ``prepare`` (``model.fp8_layer_filter``)."""
    from accelerate.utils import AORecipeKwargs
    from torchao.float8 import Float8LinearConfig

    return AORecipeKwargs(config=Float8LinearConfig(enable_fsdp_float8_all_gather=False))
