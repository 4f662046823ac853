"""Long context on CPU: one step's peak memory per rank, the chunked loss against full logits (``loss``), sequence
parallelism against whole sequences (``sp``), beside ``lmrecipe.planning.memory``'s estimate.

    bench/run.py long_context loss   # vocab 128,256, seq 2,048, micro-batch 2: full logits vs chunked, 1 process
    bench/run.py long_context sp     # seq 8,192 and 16,384: sp=1 on 1 process vs sp=2 on 2 (DeepSpeed ZeRO-1)

Each configuration in fresh processes; a step's peak is the resident high-water mark (reset before it) less the size
before it, with glibc's mmap threshold at 64 KiB so that freed tensors leave the resident set
(docs/benchmarks/11-long-context.md).
"""

import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import _common as C

STEPS = 5  # 2 of warm-up, 3 measured
LOSS_MODEL = ["model.hidden_size=64", "model.num_layers=2", "model.num_heads=4", "model.intermediate_size=128",
              "model.vocab_size=128256", "model.vocab_beyond_data=true", "data.seq_len=2048",
              "train.micro_batch_size=2", "train.global_batch_size=2", "data.document_masking=false"]
SP_MODEL = ["model.hidden_size=256", "model.num_layers=2", "model.num_heads=4", "train.micro_batch_size=1",
            "data.document_masking=false", "train.loss_chunk_tokens=1024", "distributed.deepspeed_config=zero1"]
CONFIGS = {"loss": [("full logits", [*LOSS_MODEL, "train.loss_chunk_tokens=0"], 1),
                    ("chunked loss, 1,024 tokens", [*LOSS_MODEL, "train.loss_chunk_tokens=1024"], 1)],
           "sp": [(f"seq {seq:,}, sp={sp}", [*SP_MODEL, f"data.seq_len={seq}", "train.global_batch_size=1",
                                              f"distributed.sequence_parallel_size={sp}"], sp)
                  for seq in (8192, 16384) for sp in (1, 2)]}
PAIRS = None


def options(parser) -> None:
    parser.add_argument("what", choices=list(CONFIGS))
    parser.add_argument("--out", type=Path, help="worker: the folder for its rank's result")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="an override of every configuration (e.g. data.seq_len=256: a quick check)")


def name(args) -> str:
    return f"long_context_{args.what}"


def worker(args) -> None:
    from lmrecipe.train.setup import build_run
    from lmrecipe.train.step import train_step

    cfg = C.bench_config(args.recipe, [*args.set, "logging.log_every_steps=1000"], str(args.out / "run"), args.data)
    run = build_run(cfg, args.out / "run")
    peaks, seconds = [], []
    for step in range(STEPS):
        gc.collect()
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident size
        before, start = C.status_kb("VmRSS"), time.perf_counter()
        loss = float(train_step(run, step).loss)
        seconds.append(time.perf_counter() - start)
        peaks.append((C.status_kb("VmHWM") - before) * 1024)
    (args.out / f"rank{run.accelerator.process_index}.json").write_text(json.dumps({
        "peak_bytes": max(peaks[2:]), "step_s": statistics.median(seconds[2:]), "loss": loss}))
    run.prefetcher.close()
    run.accelerator.wait_for_everyone()


def measure(args, name: str, overrides: list[str], nproc: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        overrides = [*overrides, *args.set]
        cmd = C.worker_command(args, "measure", "--out", tmp, *(f"--set={o}" for o in overrides))
        if nproc > 1:
            cmd[:1] = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(nproc),
                       "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                       "--main_process_port", str(C.free_port())]
        C.run_checked(cmd, PYTHONPATH=str(C.ROOT), MALLOC_MMAP_THRESHOLD_="65536",
                      OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 2) // nproc)))
        ranks = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(nproc)]
    return {"name": name, "peak_bytes": max(r["peak_bytes"] for r in ranks), "step_s": max(r["step_s"] for r in ranks),
            "loss": statistics.mean(r["loss"] for r in ranks), "nproc": nproc,
            "estimate_bytes": estimated_step_bytes(C.bench_config(args.recipe, overrides, "unused", args.data))}


def run(args, report) -> None:
    results = []
    for config, overrides, nproc in CONFIGS[args.what]:
        results.append(measure(args, config, overrides, nproc))
        report.line(f"measured {config}: {json.dumps(results[-1])}")
    rows, gib = [], 1024**3
    for i, r in enumerate(results):
        base = results[0] if args.what == "loss" else results[i - i % 2]
        rows.append([r["name"], r["nproc"], f"{r['peak_bytes'] / gib:.2f}", f"{r['peak_bytes'] / base['peak_bytes']:.2f}x",
                     f"{r['estimate_bytes'] / gib:.2f}", f"{r['estimate_bytes'] / r['peak_bytes']:.2f}", f"{r['step_s']:.2f}",
                     f"{r['step_s'] / base['step_s']:.2f}x", f"{r['loss']:.4f}"])
    report.table(["configuration", "processes", "peak per rank (GiB)", "vs baseline", "estimate (GiB)",
                  "estimate / measured", "step (s)", "vs baseline", "loss"], rows)
    report.figures = {r["name"]: r for r in results}


def estimated_step_bytes(cfg) -> float:
    """lmrecipe.planning.memory's step peak on one rank: one micro-batch's activations with the output layer's."""
    from lmrecipe.model.build import build_hf_config
    from lmrecipe.planning.memory import estimate_activations, model_shape
    from lmrecipe.planning.zero_comparison import recipe_vocab_size

    vocab = recipe_vocab_size(cfg.model, cfg.data)
    shape = model_shape(build_hf_config(cfg.model, vocab, cfg.data.seq_len))
    full, checkpointed = estimate_activations(
        shape, cfg.train.micro_batch_size, cfg.data.seq_len, "fp32", cfg.model.attn_implementation,
        cfg.train.chunk_tokens(vocab), cfg.distributed.sequence_parallel_size)
    return checkpointed if cfg.train.gradient_checkpointing else full
