"""Long context on CPU: the chunked loss against full logits, sequence parallelism against whole sequences.

    .venv/bin/python bench/long_context.py loss      # vocab 128,256, seq 2,048, micro-batch 2: full logits vs chunked
    .venv/bin/python bench/long_context.py sp        # seq 8,192 and 16,384: sp=1 on 1 process vs sp=2 on 2

Each configuration runs in fresh processes (``train.py``'s own ``build_run`` and ``train_step``, fp32, DeepSpeed
ZeRO-1 for both sides of ``sp``; no DeepSpeed for ``loss``). Steps 1 and 2 allocate the optimizer state and warm
up; before each later step the process's resident-memory high-water mark is reset (``/proc/self/clear_refs``) and
its current size read, after it the high-water mark: the step's peak is the difference, per rank (with glibc's
mmap threshold fixed at 64 KiB, so freed tensors leave the resident set). The loss is the mean over ranks (under
sequence parallelism each rank's loss covers its share of the window). It holds what a
step allocates and frees (activations, logits, gradients), not the weights and optimizer states held throughout.
The same run's ``lmrecipe.planning.memory`` estimate (activations of one micro-batch on one rank, output layer and its weight's
gradient included) is printed beside it. Step time: the median over the measured steps; ratios against the baseline
of the same run.

loss: a 2-layer Llama (hidden 64) with Llama-3's 128,256-token vocabulary on data/stdlib's tokens (ids below 8,192),
so the output layer dominates; ``train.loss_chunk_tokens`` 0 (full logits) and 1,024. Document masking is off in
both benchmarks: on CPU, SDPA under a boolean mask keeps a float copy of the mask per layer for its backward
(measured: +32 MiB per layer at 2 x 2,048 tokens), which is the masking's cost, not the loss's or the split's.
sp: a 2-layer Llama (hidden 256, 4 heads) with the data's 8,192-token vocabulary, ``data.document_masking=false`` (on CPU
the SDPA mask of a 16k window would hold 256 MiB per row; with masking the flash varlen path is the GPU choice),
micro-batch 1, the chunked loss on.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import _common as C  # noqa: E402

STEPS = 5
"""Steps per run: 2 of warm-up, 3 measured."""
LOSS_MODEL = ["model.hidden_size=64", "model.num_layers=2", "model.num_heads=4", "model.intermediate_size=128",
              "model.vocab_size=128256", "data.seq_len=2048", "train.micro_batch_size=2", "train.global_batch_size=2",
              "data.document_masking=false"]
SP_MODEL = ["model.hidden_size=256", "model.num_layers=2", "model.num_heads=4", "train.micro_batch_size=1",
            "data.document_masking=false", "train.loss_chunk_tokens=1024", "distributed.deepspeed_config=zero1"]


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rss_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident size


def worker(out: Path, recipe: str, data: str, overrides: list[str]) -> None:
    """Build a run as train.py does and measure each step's resident-memory peak on this rank."""
    import gc

    from lmrecipe.train.setup import build_run
    from lmrecipe.train.step import train_step

    cfg = C.bench_config(recipe, [*overrides, "logging.log_every_steps=1000"], str(out / "run"), data)
    run = build_run(cfg, out / "run")
    peaks, seconds = [], []
    for step in range(STEPS):
        gc.collect()
        reset_peak()
        before = rss_bytes("VmRSS")
        start = time.perf_counter()
        result = train_step(run, step)
        float(result.loss)  # the step's work is done (CPU: already; a GPU would sync here)
        seconds.append(time.perf_counter() - start)
        peaks.append(rss_bytes("VmHWM") - before)
    rank = run.accelerator.process_index
    n_params = sum(p.numel() for p in run.accelerator.unwrap_model(run.model).parameters())
    (out / f"rank{rank}.json").write_text(json.dumps({
        "peak_bytes": max(peaks[2:]), "step_s": statistics.median(seconds[2:]), "loss": float(result.loss),
        "n_params": n_params}))
    run.prefetcher.close()
    run.accelerator.wait_for_everyone()


def measure(name: str, recipe: str, data: str, overrides: list[str], nproc: int) -> dict:
    """One configuration in fresh processes: per-rank peaks and step times, and the estimate of the same run."""
    import subprocess

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        args = [str(Path(__file__).resolve()), "worker", "--out", str(out), "--recipe", recipe, "--data", data,
                *overrides]
        cmd = ([sys.executable] if nproc == 1 else
               [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(nproc),
                "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
                str(free_port())])
        # A fixed mmap threshold: every allocation of 64 KiB or more is mapped and unmapped, so the resident size
        # follows the tensors alive (glibc's dynamic threshold would keep freed ones of up to 32 MiB in its heap).
        env = {**os.environ, "PYTHONPATH": str(C.ROOT), "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // nproc)),
               "MALLOC_MMAP_THRESHOLD_": "65536"}
        proc = subprocess.run([*cmd, *args], cwd=C.ROOT, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{name} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]
    cfg = C.bench_config(recipe, overrides, "unused", data)
    estimate = estimated_step_bytes(cfg, nproc, ranks[0]["n_params"])
    return {"name": name, "peak_bytes": max(r["peak_bytes"] for r in ranks), "step_s": max(r["step_s"] for r in ranks),
            "loss": statistics.mean(r["loss"] for r in ranks), "estimate_bytes": estimate, "nproc": nproc}


def estimated_step_bytes(cfg, world_size: int, n_params: int) -> float:
    """What lmrecipe.planning.memory says a step's peak holds on one rank: one micro-batch's activations with the output
    layer's (the peak is in the output layer's backward, before any other layer's gradient exists)."""
    from lmrecipe.data.format import load_meta
    from lmrecipe.planning.memory import estimate_activations, model_shape
    from lmrecipe.model.build import build_hf_config

    vocab = cfg.model.vocab_size or int(load_meta(cfg.data.path)["vocab_size"])
    shape = model_shape(build_hf_config(cfg.model, vocab, cfg.data.seq_len))
    full, checkpointed = estimate_activations(
        shape, cfg.train.micro_batch_size, cfg.data.seq_len, "fp32", cfg.model.attn_implementation,
        cfg.train.chunk_tokens(vocab), cfg.distributed.sequence_parallel_size)
    return checkpointed if cfg.train.gradient_checkpointing else full


def row(result: dict, baseline: dict) -> str:
    gib = 1024**3
    return (f"| {result['name']} | {result['nproc']} | {result['peak_bytes'] / gib:.2f} | "
            f"{result['peak_bytes'] / baseline['peak_bytes']:.2f}x | {result['estimate_bytes'] / gib:.2f} | "
            f"{result['estimate_bytes'] / result['peak_bytes']:.2f} | {result['step_s']:.2f} | "
            f"{result['step_s'] / baseline['step_s']:.2f}x | {result['loss']:.4f} |")


HEADER = ("| configuration | processes | peak per rank (GiB) | vs baseline | estimate (GiB) | estimate / measured | "
          "step (s) | vs baseline | loss |\n|---|---|---|---|---|---|---|---|---|")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("loss", "sp", "worker"))
    parser.add_argument("--recipe", default="recipes/tiny.yaml")
    parser.add_argument("--data", default="data/stdlib")
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_intermixed_args()
    if args.what == "worker":
        worker(args.out, args.recipe, args.data, args.overrides)
        return 0
    C.check_data(args.data)
    report = C.Report(f"long_context_{args.what}")
    if args.what == "loss":
        configs = [("full logits", [*LOSS_MODEL, "train.loss_chunk_tokens=0"], 1),
                   ("chunked loss, 1,024 tokens", [*LOSS_MODEL, "train.loss_chunk_tokens=1024"], 1)]
    else:
        configs = [(f"seq {seq:,}, sp={sp}", [*SP_MODEL, f"data.seq_len={seq}", f"train.global_batch_size={1}",
                                              f"distributed.sequence_parallel_size={sp}"], sp)
                   for seq in (8192, 16384) for sp in (1, 2)]
    results = []
    for name, overrides, nproc in configs:
        results.append(measure(name, args.recipe, args.data, overrides, nproc))
        report.line(f"measured {name}: {json.dumps(results[-1])}")
    report.line()
    report.line(HEADER)
    for i, result in enumerate(results):
        baseline = results[0] if args.what == "loss" else results[i - i % 2]
        report.line(row(result, baseline))
    report.figures = {r["name"]: r for r in results}
    report.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
