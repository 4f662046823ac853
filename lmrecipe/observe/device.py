"""Device figures of a training step: peak FLOP/s, MFU, peak memory and NVML utilisation.
"""

from __future__ import annotations

import functools
import logging
import resource
import sys
import time

import torch

logger = logging.getLogger(__name__)

# Dense peak TFLOP/s per GPU by name fragment (no sparsity), for bf16/fp16 and for fp32 (TF32 off).
_GPU_PEAK_TFLOPS = {
    "H200": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0},
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "fp32": 51.0},
    "H100": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0},
    "A100": {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
    "A10G": {"bf16": 125.0, "fp16": 125.0, "fp32": 31.2},
    "L40S": {"bf16": 362.0, "fp16": 362.0, "fp32": 91.6},
    "L4": {"bf16": 121.0, "fp16": 121.0, "fp32": 30.3},
    "V100": {"bf16": 0.0, "fp16": 125.0, "fp32": 15.7},
    "RTX 4090": {"bf16": 165.0, "fp16": 165.0, "fp32": 82.6},
    "RTX 3090": {"bf16": 71.0, "fp16": 71.0, "fp32": 35.6},
}


def gpu_peak_tflops(device_name: str, precision: str) -> float | None:
    for fragment, peaks in _GPU_PEAK_TFLOPS.items():
        if fragment in device_name:
            return peaks.get(precision) or None
    return None


@functools.lru_cache(maxsize=4)
def cpu_matmul_tflops(precision: str = "fp32", size: int = 1024, trials: int = 5, seconds: float = 0.1) -> float:
    """Measured matmul TFLOP/s of this CPU with the current thread count: the peak MFU is judged against.

    The best of several short trials, so a moment of contention from other processes lowers it less.
    """
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
    a = torch.randn(size, size, dtype=dtype)
    b = torch.randn(size, size, dtype=dtype)
    a @ b  # warm-up: first call allocates and picks the kernel
    best = 0.0
    for _ in range(trials):
        n, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            a @ b
            n += 1
        best = max(best, 2.0 * size**3 * n / (time.perf_counter() - start) / 1e12)
    return best


def device_peak_tflops(device: torch.device, precision: str, configured: float | None) -> tuple[float, str]:
    """Peak TFLOP/s of one device and where the figure came from. fp8 is judged against the bf16 peak: its
    mixed-precision path is bf16, and a higher MFU is then the float8 matmuls' gain."""
    if configured is not None:
        return configured, "configured"
    precision = "bf16" if precision == "fp8" else precision
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = gpu_peak_tflops(name, precision)
        if peak is not None:
            return peak, f"table ({name})"
        logger.warning("No peak TFLOP/s known for %s; set logging.peak_tflops for MFU. Probing a matmul instead.", name)
    return cpu_matmul_tflops(precision), "matmul probe"


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_gb(device: torch.device) -> float:
    """GPU: the allocator's peak since the last reset. CPU: the process's peak resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 1e9 if sys.platform == "darwin" else rss * 1024 / 1e9


@functools.lru_cache(maxsize=16)
def _nvml_handle(index: int):
    """NVML's handle of CUDA device ``index`` (matched by UUID, so CUDA_VISIBLE_DEVICES is respected), or None."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # no nvidia-ml-py, or no driver: utilisation is simply not reported
        return None
    uuid = str(torch.cuda.get_device_properties(index).uuid)
    try:
        return pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
    except Exception:
        try:
            return pynvml.nvmlDeviceGetHandleByIndex(index)
        except Exception:
            return None


def device_utilisation(device: torch.device) -> dict:
    """GPU utilisation (%, over NVML's last sample period) and memory in use (GB, all processes), or nulls.

    Read from NVML (``nvidia-ml-py``) at log steps only; on a CPU, or without NVML, both are None.
    """
    empty = {"gpu_util_pct": None, "gpu_mem_used_gb": None}
    if device.type != "cuda":
        return empty
    handle = _nvml_handle(device.index if device.index is not None else torch.cuda.current_device())
    if handle is None:
        return empty
    import pynvml

    try:
        util = pynvml.nvmlDeviceGetUtilizationRates(handle)
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
    except Exception:
        return empty
    return {"gpu_util_pct": float(util.gpu), "gpu_mem_used_gb": memory.used / 1e9}


def mfu(tokens_per_sec: float, flops_per_token: float, world_size: int, peak_tflops: float) -> float:
    """Model FLOPs utilisation: achieved training FLOP/s over the peak of all devices."""
    return tokens_per_sec * flops_per_token / (world_size * peak_tflops * 1e12)
