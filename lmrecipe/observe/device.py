"""Device figures of a training step: peak FLOP/s, MFU, peak memory and NVML utilisation.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import platform
import resource
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from lmrecipe.fileio import write_json_atomic

logger = logging.getLogger(__name__)

_H100_MEASURED = ("measured: this recipe's 1B model on one H100, bf16, ZeRO-2, accumulation 2, varlen, Liger, full logits "
                  "(docs/benchmarks/gpu.md)")
_H100_LIKE = "not measured on this device: the H100's measured 41.1% (docs/benchmarks/gpu.md), at the same bf16 peak"
_A100_MFU = ("Narayanan et al. 2021 (Megatron-LM): 52% of peak, GPT-3 175B on 3,072 A100s; MegaScale "
             "(Jiang et al. 2024): 55.2% on 12,288 GPUs")
_OTHER_MFU = "no large-scale figure published; the H100's measured 41.1% assumed"
_MiB = 2**20


@dataclass(frozen=True)
class Device:
    """One kind of accelerator: what MFU is measured against and what the planner assumes of it."""

    name: str
    """A fragment of the name torch gives the device (``NVIDIA H100 80GB HBM3`` holds ``H100``); ``cpu``."""
    peak_tflops: dict[str, float]
    """Dense peak TFLOP/s (no sparsity) for bf16/fp16 and fp32 (TF32 off); empty for the CPU, whose peak is probed."""
    memory_bytes: int | None
    """Memory per device as the card reports it to a program (``torch.cuda.get_device_properties().total_memory``:
    an "80 GB" H100 reports 79.2 GiB, 85.0e9 bytes); None = this host's RAM (the CPU)."""
    mfu: float
    """MFU assumed for a large run (the planner's default): this recipe's measured figure where one exists."""
    mfu_source: str


def _peaks(bf16: float, fp32: float, fp16: float | None = None) -> dict[str, float]:
    return {"bf16": bf16, "fp16": bf16 if fp16 is None else fp16, "fp32": fp32}


# Memory: total_memory as torch reports it (its repr rounds to MiB): H100 80GB HBM3 81,090 MiB (79.2 GiB, as
# bench/gpu/results/ recorded), H200 143,156, H100 PCIe 81,008, A100-SXM4-80GB 81,920, A100-SXM4-40GB 40,536,
# L40S 45,589, A10G 22,587, V100-32GB 32,510, RTX 4090 24,563, RTX 3090 24,268; the L4's 23,034 is nvidia-smi's.
DEVICES = {
    "h100": Device("H100", _peaks(989.0, 67.0), 81_090 * _MiB, 0.411, _H100_MEASURED),
    "h100-pcie": Device("H100 PCIe", _peaks(756.0, 51.0), 81_008 * _MiB, 0.411, _H100_LIKE),
    "h200": Device("H200", _peaks(989.0, 67.0), 143_156 * _MiB, 0.411, _H100_LIKE),
    "a100": Device("A100", _peaks(312.0, 19.5), 81_920 * _MiB, 0.50, _A100_MFU),
    "a100-40gb": Device("A100", _peaks(312.0, 19.5), 40_536 * _MiB, 0.50, _A100_MFU),
    "l40s": Device("L40S", _peaks(362.0, 91.6), 45_589 * _MiB, 0.411, _OTHER_MFU),
    "a10g": Device("A10G", _peaks(125.0, 31.2), 22_587 * _MiB, 0.411, _OTHER_MFU),
    "l4": Device("L4", _peaks(121.0, 30.3), 23_034 * _MiB, 0.411, _OTHER_MFU),
    "v100": Device("V100", _peaks(0.0, 15.7, fp16=125.0), 32_510 * _MiB, 0.411, _OTHER_MFU),
    "rtx-4090": Device("RTX 4090", _peaks(165.0, 82.6), 24_563 * _MiB, 0.411, _OTHER_MFU),
    "rtx-3090": Device("RTX 3090", _peaks(71.0, 35.6), 24_268 * _MiB, 0.411, _OTHER_MFU),
    "cpu": Device("cpu", {}, None, 0.40, "BENCHMARKS.md section 5: the tiny recipe at 38-42% of this CPU's matmul peak"),
}
"""The one device catalogue: MFU's peaks (:func:`device_peak_tflops`) and the planner's devices (``--gpu`` keys)."""


def device_named(device_name: str | None) -> Device:
    """The catalogue's entry for a device as torch names it (the longest matching fragment: ``H100 PCIe`` before
    ``H100``); the CPU's for None or an unknown name."""
    if device_name:
        for device in sorted(DEVICES.values(), key=lambda d: -len(d.name)):
            if device.name != "cpu" and device.name in device_name:
                return device
    return DEVICES["cpu"]


def gpu_peak_tflops(device_name: str, precision: str) -> float | None:
    """The catalogue's dense peak of a GPU as torch names it; None when unknown (or 0: no such precision)."""
    device = device_named(device_name)
    return device.peak_tflops.get(precision) or None


PEAK_CACHE_FILE = "peak_tflops.json"
PEAK_HISTORY = 16
"""Probes kept per machine key in the cache; the reference is the highest of them."""


def probe_cpu_matmul_tflops(precision: str = "fp32", size: int = 1024, trials: int = 5, seconds: float = 0.04) -> float:
    """One probe of this CPU's matmul TFLOP/s with the current thread count: the median of ``trials`` timed bursts
    of ``seconds`` each, after a warm-up burst (the first calls allocate, pick the kernel and wake the threads).

    The median, not the best: under other processes' load the best burst swings with the moment's contention.
    """
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
    a = torch.randn(size, size, dtype=dtype)
    b = torch.randn(size, size, dtype=dtype)

    def burst() -> float:
        n, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            a @ b
            n += 1
        return 2.0 * size**3 * n / (time.perf_counter() - start) / 1e12

    burst()
    return statistics.median(burst() for _ in range(trials))


def peak_cache_path() -> Path:
    """``$XDG_CACHE_HOME/lmrecipe/peak_tflops.json`` (``~/.cache/lmrecipe/...`` by default)."""
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "lmrecipe" / PEAK_CACHE_FILE


def machine_key(precision: str) -> str:
    """What a CPU peak depends on: the CPU model, torch's version and thread count, the precision."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.partition(":")[2].strip()
                break
    except OSError:
        pass
    return f"{model} | torch {torch.__version__} | {torch.get_num_threads()} threads | {precision}"


def remembered_peak(path: Path, key: str, probe: float, keep: int = PEAK_HISTORY) -> tuple[float, int]:
    """Add ``probe`` to the last ``keep`` probes cached under ``key`` and return (the highest of them, how many).

    A cache that cannot be read starts empty; one that cannot be written leaves the highest of what was read.
    """
    try:
        cache = json.loads(path.read_text())
        history = [float(x) for x in cache.get(key, []) if float(x) > 0] if isinstance(cache, dict) else []
    except (OSError, ValueError, TypeError, AttributeError):
        cache, history = {}, []
    history = [*history, probe][-keep:]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, {**(cache if isinstance(cache, dict) else {}), key: history})
    except OSError as err:
        logger.debug("CPU peak cache %s not written: %s", path, err)
    return max(history), len(history)


@functools.lru_cache(maxsize=4)
def cpu_matmul_tflops(precision: str = "fp32") -> float:
    """The CPU peak MFU is judged against: the highest of this machine's last probes (:data:`PEAK_HISTORY`, this
    one included) under its :func:`machine_key`, cached in :func:`peak_cache_path`. Other processes on the cores
    only ever lower a probe, so one probe swings with their load (0.03 to 0.20 TFLOP/s on one 2-core machine) while
    the highest of the recent ones stays at what the machine can do."""
    peak, count = remembered_peak(peak_cache_path(), machine_key(precision), probe_cpu_matmul_tflops(precision))
    logger.debug("CPU matmul peak %.3f TFLOP/s: the highest of %d probes", peak, count)
    return peak


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
    return cpu_matmul_tflops(precision), f"matmul probe: the highest of up to {PEAK_HISTORY} probes cached per machine"


def cpu_threads_line(processes: int) -> str:
    """The start-up line of a run on CPUs: torch's threads per process against the cores this process may use, and
    what to set when other work shares them (each step waits for its slowest thread)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return (f"CPU: {processes} process(es) x {torch.get_num_threads()} torch threads on {cores} cores. On a CPU shared "
            "with other work, set OMP_NUM_THREADS to the cores free for this run divided by its processes (e.g. "
            "OMP_NUM_THREADS=1 python train.py ...): a thread that waits for a busy core stalls every step.")


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_gb(device: torch.device) -> float:
    """GPU: the allocator's peak since the last reset. CPU: the process's peak resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 1e9 if sys.platform == "darwin" else rss * 1024 / 1e9


def host_rss_gb() -> float:
    """The process's resident set now (host memory, GB), which the operating system can report on any device."""
    import psutil

    return psutil.Process().memory_info().rss / 1e9


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
