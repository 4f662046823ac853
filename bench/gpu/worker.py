"""One side of a GPU-kit stage, measured in this process: ``build_run`` and ``train_step`` of ``lmrecipe.train``.

After ``warmup_steps`` steps, ``steps`` steps run back to back between two device syncs. Figures: tokens/s and MFU;
the step peak (``max_memory_allocated`` less what was held before); data wait; host syncs (``HostSyncCounter`` and
torch.cuda's sync debug mode); the checkpoint stall (``_common.save_round``); one profiled step; the planner's
prediction. The result so far is written after the timed steps and after each slow measurement, so a worker stopped
by ``--budget-s`` keeps its timed figures.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import platform
import shutil
import sys
import time
import warnings
from pathlib import Path

import _common as C  # bench/, on the PYTHONPATH run.py gives the workers

GIB = 1024**3
SYNC_STEPS = 5  # steps whose host syncs are counted, after the timed ones (counting slows every tensor call)
PROFILE_TOP = 15  # kernels (operators on a CPU) kept from a profiled step, by time


def _count_syncs(run, first_step: int, steps: int) -> dict:
    """Host syncs per step over ``steps`` steps: the project's counter, and torch.cuda's own sync warnings."""
    import torch

    from lmrecipe.observe.host_syncs import HostSyncCounter
    from lmrecipe.train.step import train_step

    device, cuda = run.accelerator.device, run.accelerator.device.type == "cuda"
    C.sync(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            with HostSyncCounter() as counter:
                for step in range(first_step, first_step + steps):
                    train_step(run, step)
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode(0)
    cuda_syncs = [f"{Path(w.filename).name}:{w.lineno}" for w in caught if "synchroniz" in str(w.message).lower()]
    return {"per_step": counter.total / steps, "by_kind": {k: v / steps for k, v in sorted(counter.calls.items())},
            "sources": counter.sources, "in_optimizer": counter.in_optimizer,
            "cuda_per_step": len(cuda_syncs) / steps if cuda else None, "cuda_sources": sorted(set(cuda_syncs))[:20]}


def _busy_us(intervals: list[tuple[float, float]]) -> float:
    """Microseconds covered by the union of ``intervals`` (kernels of several streams overlap)."""
    busy, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    return busy


def _profile_step(run, step: int, top: int = PROFILE_TOP) -> dict:
    """One step under ``torch.profiler``: its wall time, the GPU's busy share of it and the kernels (on a CPU: the
    operators) that took the most time."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from lmrecipe.train.step import train_step

    device, cuda = run.accelerator.device, run.accelerator.device.type == "cuda"
    C.sync(device)
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        start = time.perf_counter()
        train_step(run, step)
        C.sync(device)
        wall_s = time.perf_counter() - start
    by_name: dict[str, float] = {}
    if cuda:
        # record_function ranges (lmrecipe/forward, ...) have device-side copies spanning the step: left out
        kernels = [e for e in prof.events()
                   if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)]
        for e in kernels:
            by_name[e.name] = by_name.get(e.name, 0.0) + e.time_range.elapsed_us()
        busy_us = _busy_us([(e.time_range.start, e.time_range.end) for e in kernels])
    else:
        for e in prof.key_averages():
            if not getattr(e, "is_user_annotation", False):
                by_name[e.key] = e.self_cpu_time_total
        busy_us = None
    total_us = sum(by_name.values())
    return {"wall_s": wall_s, "device_busy_share": None if busy_us is None else busy_us / (wall_s * 1e6),
            "timed": "GPU kernels and copies" if cuda else "CPU operators (self time)",
            "top": [{"name": name[:160], "ms": us / 1e3, "share": us / total_us if total_us else None}
                    for name, us in sorted(by_name.items(), key=lambda kv: -kv[1])[:top]]}


def _checkpoint_stall(run, out_dir: Path, first_step: int, steps_between: int) -> dict:
    """Loop time blocked by one save of each kind (a round of ``bench/run.py checkpoint_stall`` each)."""
    from lmrecipe.train.state import TrainState

    state, result = TrainState(step=first_step), {"steps_between": steps_between}
    for kind in ("sync", "background"):
        result[kind] = C.save_round(run, C.side_checkpointer(run, out_dir / kind, kind == "background"), state, steps_between)
        result["checkpoint_gb"] = C.folder_mb(out_dir / kind) / 1e3
        shutil.rmtree(out_dir / kind)
    return result


def _prediction(run, peak_tflops: float) -> dict:
    import torch
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    from lmrecipe.planning.prediction import predict_run

    unset_hf_deepspeed_config()  # a live ZeRO-3 config would make the meta-device shape enter zero.Init
    device, runtime = run.accelerator.device, run.runtime
    return predict_run(run.cfg.workload(), run.accelerator.unwrap_model(run.model).config, topology=runtime.topology,
                       precision=runtime.precision, accum_steps=runtime.batch.accum_steps, flops_per_token=run.flops_per_token,
                       peak_tflops=peak_tflops, device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else None)


def measure(cfg, out_dir: Path, side: dict, warmup_steps: int, steps: int, save=lambda result: None) -> dict:
    """Build the run of ``cfg`` and measure it as ``side`` (a ``stages.Side`` as a dict) asks; ``save`` gets the result
    so far after the timed steps and after each slow measurement."""
    import torch

    from lmrecipe.observe.device import device_peak_tflops, mfu
    from lmrecipe.train.setup import build_run
    from lmrecipe.train.step import train_step

    start = time.perf_counter()
    run = build_run(cfg, out_dir)
    device, build_s = run.accelerator.device, time.perf_counter() - start
    try:
        for step in range(warmup_steps):
            train_step(run, step)
        C.sync(device)
        cuda = device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        held, data_s, start = torch.cuda.memory_allocated(device) if cuda else None, 0.0, time.perf_counter()
        for step in range(warmup_steps, warmup_steps + steps):
            last = train_step(run, step)
            data_s += last.data_time_s
        C.sync(device)
        seconds = time.perf_counter() - start
        peak_tflops, peak_source = device_peak_tflops(device, run.runtime.precision, None)
        tokens_per_sec = steps * run.tokens_per_step / seconds
        peak = torch.cuda.max_memory_allocated(device) if cuda else None
        result = {
            "label": side["label"], "overrides": side["overrides"], "device": str(device), "precision": run.runtime.precision,
            "zero": run.runtime.topology.zero.describe(), "attention": cfg.model.attn_implementation,
            "document_masking": cfg.data.document_masking, "n_params": run.n_params, "tokens_per_step": run.tokens_per_step,
            "micro_batch_size": cfg.train.micro_batch_size, "accum_steps": run.runtime.batch.accum_steps,
            "warmup_steps": warmup_steps, "steps": steps, "build_s": build_s, "step_time_s": seconds / steps,
            "tokens_per_sec": tokens_per_sec, "mfu": mfu(tokens_per_sec, run.flops_per_token, 1, peak_tflops) if cuda else None,
            "peak_tflops": peak_tflops, "peak_source": peak_source, "step_peak_gib": (peak - held) / GIB if cuda else None,
            "peak_gib": peak / GIB if cuda else None, "held_gib": held / GIB if cuda else None,
            "data_wait_s_per_step": data_s / steps, "data_share": data_s / seconds, "loss": float(last.loss)}
        save(result)
        next_step = warmup_steps + steps
        if side["count_syncs"]:
            sync_steps = min(steps, SYNC_STEPS)
            result["host_syncs"] = _count_syncs(run, next_step, sync_steps)
            next_step += sync_steps
        if side["profile"]:
            try:
                result["profile"] = _profile_step(run, next_step)
            except Exception as exc:  # a profiler that fails leaves the side's other figures
                result["profile"] = {"error": f"{type(exc).__name__}: {exc}"[:1000]}
            next_step += 1
            save(result)
        if side["checkpoint_stall"]:
            result["checkpoint_stall"] = _checkpoint_stall(run, out_dir / "checkpoints", next_step, 2)
        prediction = result["prediction"] = _prediction(run, peak_tflops)
        result["measured_over_predicted"] = {"tokens_per_sec": tokens_per_sec / prediction["tokens_per_sec"],
                                             "peak_mem": (peak / 1e9 / prediction["peak_mem_gb"]) if cuda else None}
        return result
    finally:
        run.prefetcher.close()


def _forget_run() -> None:
    """Let the next side of this process (the dry run's sides share one) build its own Accelerator and engine."""
    import gc

    from accelerate.state import AcceleratorState, GradientState
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    gc.collect()


def main(argv: list[str]) -> int:
    """``worker.py JOB_JSON``: measure each side of the job, write their results to the job's ``result`` path."""
    import torch

    job = json.loads(Path(argv[0]).read_text())
    logging.basicConfig(level=logging.WARNING)
    versions = {m: C.version(m) for m in ("torch", "transformers", "accelerate", "deepspeed", "torchao", "tokenizers",
                                           "triton", "flash_attn", "safetensors", "numpy", "pydantic")}
    versions.update(python=platform.python_version(), cuda=torch.version.cuda)
    if torch.cuda.is_available():  # the device the figures are of
        props = torch.cuda.get_device_properties(0)
        versions["device"] = {"name": props.name, "count": torch.cuda.device_count(), "capability":
                              list(torch.cuda.get_device_capability(0)), "memory_gib": round(props.total_memory / 2**30, 1)}
    results = {"_versions": versions}

    def write() -> None:
        Path(job["result"]).write_text(json.dumps(results, indent=2, default=str))

    for i, side in enumerate(job["sides"]):
        out_dir, key = Path(job["work"]) / f"side{i}", side["key"]
        cfg = C.bench_config(job["recipe"], [*job["base"], *side["overrides"]], str(out_dir), job["data"])
        if side["needs"] and importlib.util.find_spec(side["needs"]) is None:
            results[key] = {"label": side["label"], "skipped": f"{side['needs']} is not installed"}
            write()
            continue
        try:
            results[key] = measure(cfg, out_dir, side, job["warmup_steps"], job["steps"],
                                   lambda result, key=key: (results.update({key: {**result, "partial": True}}), write()))
        except Exception as exc:  # one side's failure is a figure too: the stage reports it
            logging.getLogger(__name__).exception("side %s failed", side["label"])
            results[key] = {"label": side["label"], "error": f"{type(exc).__name__}: {exc}"[:2000]}
        write()
        if i + 1 < len(job["sides"]):
            _forget_run()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
