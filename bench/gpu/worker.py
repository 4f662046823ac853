"""One side of a GPU-kit stage, measured in this process: ``build_run`` and ``train_step`` of ``lmrecipe.train``.

After ``warmup_steps`` steps, ``steps`` steps run back to back between two device syncs (``levers.window``). Figures:
tokens/s and MFU; the step peak; data wait; the planner's prediction. A side of the ``levers`` stage is measured by
``levers.py`` instead. The result so far is written after the timed steps and after each slow measurement, so a
worker stopped by ``--budget-s`` keeps its timed figures.
"""

import gc
import json
import logging
import platform
import sys
import time
from pathlib import Path

import _common as C  # bench/, on the PYTHONPATH run.py gives the workers
import levers as L  # beside this file
import torch
from accelerate.state import AcceleratorState, GradientState
from transformers.integrations.deepspeed import unset_hf_deepspeed_config

from lmrecipe.cli import use_environment_ninja
from lmrecipe.observe.device import device_peak_tflops
from lmrecipe.planning.prediction import predict_run
from lmrecipe.train.setup import build_run

def _prediction(run, peak_tflops: float) -> dict:
    unset_hf_deepspeed_config()  # a live ZeRO-3 config would make the meta-device shape enter zero.Init
    device, runtime = run.accelerator.device, run.runtime
    return predict_run(run.cfg.workload(), run.accelerator.unwrap_model(run.model).config, topology=runtime.topology,
                       precision=runtime.precision, accum_steps=runtime.batch.accum_steps, flops_per_token=run.flops_per_token,
                       peak_tflops=peak_tflops, device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else None)


def measure(cfg, out_dir: Path, side: dict, warmup_steps: int, steps: int, save=lambda result: None) -> dict:
    """Build the run of ``cfg`` and measure it as ``side`` (a ``stages.Side`` as a dict) asks; ``save`` gets the result
    so far after the timed steps and after each slow measurement."""
    start = time.perf_counter()
    run = build_run(cfg, out_dir)
    build_s = time.perf_counter() - start
    try:
        figures, _ = L.window(run, 0, warmup_steps, steps)
        result = {
            "label": side["label"], "overrides": side["overrides"], "device": str(run.accelerator.device),
            "precision": run.runtime.precision, "zero": run.runtime.topology.zero.describe(),
            "attention": cfg.model.attn_implementation, "document_masking": cfg.data.document_masking,
            "n_params": run.n_params, "micro_batch_size": cfg.train.micro_batch_size,
            "accum_steps": run.runtime.batch.accum_steps, "warmup_steps": warmup_steps, "steps": steps, "build_s": build_s,
            **figures}
        save(result)
        if figures["peak_tflops"] is None:  # a CPU's, probed
            result["peak_tflops"], result["peak_source"] = device_peak_tflops(run.accelerator.device, run.runtime.precision, None)
        prediction = result["prediction"] = _prediction(run, result["peak_tflops"])
        peak = figures["peak_gib"]
        result["measured_over_predicted"] = {
            "tokens_per_sec": figures["tokens_per_sec"] / prediction["tokens_per_sec"],
            "peak_mem": None if peak is None else peak * L.GIB / 1e9 / prediction["peak_mem_gb"]}
        return result
    finally:
        run.prefetcher.close()
        run.accelerator.free_memory()  # DeepSpeed's gradient hooks would keep the run alive for the next side


def _forget_run() -> None:
    """Let the next side of this process (the dry run's sides share one) build its own Accelerator and engine."""
    unset_hf_deepspeed_config()
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    gc.collect()


def main(argv: list[str]) -> int:
    """``worker.py JOB_JSON``: measure each side of the job, write their results to the job's ``result`` path."""
    use_environment_ninja()  # as the project's scripts: the other ninja's build log would compile DeepSpeed's ops again
    job = json.loads(Path(argv[0]).read_text())
    logging.basicConfig(level=logging.WARNING)
    versions = {m: C.version(m) for m in (*C.VERSIONED, "torchao", "triton", "liger_kernel", "safetensors", "pydantic")}
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
        def config_of(extra, out_dir=out_dir, side=side):
            return C.bench_config(job["recipe"], [*job["base"], *side["overrides"], *extra], str(out_dir), job["data"])

        def save(result, key=key):
            results.update({key: {**result, "partial": True}})
            write()

        try:
            if side["levers"]:
                results[key] = L.measure_levers(config_of, out_dir, side, job["warmup_steps"], job["steps"], save, _forget_run)
            else:
                results[key] = measure(config_of([]), out_dir, side, job["warmup_steps"], job["steps"], save)
        except Exception as exc:  # one side's failure is a figure too: the stage reports it
            logging.getLogger(__name__).exception("side %s failed", side["label"])
            results[key] = {**results.get(key, {}), "label": side["label"], "error": f"{type(exc).__name__}: {exc}"[:2000]}
        write()
        if i + 1 < len(job["sides"]):
            _forget_run()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
