"""The planner's arithmetic at a finished run's own configuration: what ``report.md`` sets beside the measured
tokens/s, MFU, step time and peak memory."""

from __future__ import annotations

from pathlib import Path

from lmrecipe.config import Workload
from lmrecipe.data.batches import BatchRamp
from lmrecipe.planning.memory import estimate_run, model_shape, read_measured
from lmrecipe.observe.device import device_named
from lmrecipe.parallel.topology import Topology


def predict_run(work: Workload, hf_config, *, topology: Topology, precision: str, accum_steps: int,
                flops_per_token: float, peak_tflops: float, device_name: str | None,
                out_dir: str | Path | None = None) -> dict:
    """What the planner predicts for this run's own workload (``Config.workload()``), for ``report.md``: tokens/s (all
    devices), MFU, the step time (one optimizer step at ``train.global_batch_size``), the run's tokens and time in training
    steps (``train.max_steps`` steps at their sizes: a batch-size ramp's smaller steps count as they are), the per-process
    peak memory (GB = 1e9 bytes) and the model states; with ``out_dir``, the model states measured by
    ``logging.measure_model_states`` (largest rank) beside them."""
    device = device_named(device_name)
    tokens_per_sec = device.mfu * peak_tflops * 1e12 * topology.world_size / flops_per_token
    est = estimate_run(model_shape(hf_config), work, topology, precision, accum_steps)
    measured = read_measured(out_dir) if out_dir is not None else []
    run_tokens = BatchRamp(work.train.ramp_points()).start(work.train.max_steps) * work.data.seq_len
    return {
        "tokens_per_sec": tokens_per_sec, "mfu": device.mfu, "mfu_source": device.mfu_source,
        "step_time_s": work.train.global_batch_size * work.data.seq_len / tokens_per_sec,
        "run_tokens": run_tokens, "run_time_s": run_tokens / tokens_per_sec,
        "peak_mem_gb": est.device_total / 1e9, "model_states_gb": est.model_states / 1e9,
        "model_states_measured_gb": max(m["total"] for m in measured) / 1e9 if measured else None,
    }
