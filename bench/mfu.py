"""MFU: achieved training FLOP/s over a measured matmul peak (CPU), or over the GPU's datasheet peak (train.py's MFU).

    .venv/bin/python bench/mfu.py                                   # CPU: the tiny recipe and a 512-wide, 8-layer model
    .venv/bin/python bench/mfu.py --models large --pairs 5
    .venv/bin/python bench/mfu.py --device cuda                     # GPU: recipes/llama_1b.yaml, bf16, ZeRO-2, SDPA
    .venv/bin/python bench/mfu.py --device cuda --ds-configs ds_configs/zero1.json ds_configs/zero2.json ds_configs/zero3.json

CPU: each model in its own process, alternating (A B, B A, ...) a training block of --block-steps steps (the
body of lmrecipe.train, bench/_common.py: OursLoop) with two peak probes:
- square: lmrecipe.observe.device.cpu_matmul_tflops's probe (1024 x 1024 fp32 matmul, its defaults), the peak train.py's MFU uses;
- model shapes: every Linear GEMM of one training micro-step at the model's own shapes (forward X W^T, backward
  dY W and dY^T X), FLOP-weighted: the best a dense kernel does at these sizes.
Achieved FLOP/s = lmrecipe.model.build.flops_per_token (6 x non-embedding params + attention) x tokens/s. Each pair gives
achieved / peak, reported as the median with min and max.

GPU: train.py itself (subprocess, one process) on the 1B recipe with each --ds-configs JSON, on data/stdlib with
the Llama-3 vocabulary size (model.vocab_size=128256) so the model keeps its 1.24B shape; tokens/s and MFU are
train.py's own metrics.jsonl figures (peak from lmrecipe.metrics' table), median over the rows after --warmup-steps.
Target on one H100/H200: >= 45%.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _common as C  # noqa: E402

MODELS = {
    "tiny": ["recipes/tiny.yaml", []],
    "large": ["recipes/tiny.yaml", ["model.hidden_size=512", "model.num_layers=8", "model.num_heads=8",
                                    "model.intermediate_size=null", "data.seq_len=256", "train.global_batch_size=16",
                                    "train.micro_batch_size=8"]],
}


def linear_gemms(hf_config, tokens: int) -> list[tuple[int, int, int, int]]:
    """(count, M, K, N) of the forward GEMMs of the model's Linear layers for ``tokens`` tokens (x W^T: M x K by K x N)."""
    h, i, v = hf_config.hidden_size, hf_config.intermediate_size, hf_config.vocab_size
    heads, kv = hf_config.num_attention_heads, hf_config.num_key_value_heads
    kv_dim = h // heads * kv
    layers = hf_config.num_hidden_layers
    # q and o; k and v; gate and up; down; the output projection.
    return [(2 * layers, tokens, h, h), (2 * layers, tokens, h, kv_dim), (2 * layers, tokens, h, i), (layers, tokens, i, h),
            (1, tokens, h, v)]


def model_shape_tflops(hf_config, tokens: int, seconds: float = 0.5, trials: int = 3) -> float:
    """FLOP-weighted fp32 GEMM TFLOP/s over forward and backward of every Linear of one micro-step.

    Each GEMM keeps its best of ``trials`` timings, as lmrecipe.observe.device.cpu_matmul_tflops does for the square probe.
    """
    import torch

    total_flops, total_seconds = 0.0, 0.0
    budget = seconds / (3 * trials * len(linear_gemms(hf_config, tokens)))
    for count, m, k, n in linear_gemms(hf_config, tokens):
        x, w, dy = torch.randn(m, k), torch.randn(n, k), torch.randn(m, n)
        # The three products autograd runs for a Linear: forward, input gradient, weight gradient.
        for fn in (lambda: torch.nn.functional.linear(x, w), lambda: dy.mm(w), lambda: dy.t().mm(x)):
            fn()
            best = float("inf")
            for _ in range(trials):
                reps, start = 0, time.perf_counter()
                while time.perf_counter() - start < budget or reps < 2:
                    fn()
                    reps += 1
                best = min(best, (time.perf_counter() - start) / reps)
            total_flops += count * 2.0 * m * k * n
            total_seconds += count * best
    return total_flops / total_seconds / 1e12


def cpu_worker(args) -> dict:
    from lmrecipe.observe.device import probe_cpu_matmul_tflops

    recipe, overrides = MODELS[args.worker]
    with tempfile.TemporaryDirectory(prefix="bench_mfu_") as tmp:
        cfg = C.bench_config(recipe, overrides, out_dir=tmp, data_path=args.data)
        ours = C.OursLoop(cfg, Path(tmp))
        device = ours.accelerator.device
        tokens = cfg.train.micro_batch_size * cfg.data.seq_len
        desc = (f"{args.worker}: {ours.n_params / 1e6:.1f}M params ({cfg.model.num_layers} layers x {cfg.model.hidden_size}, "
                f"mlp {ours.hf_config.intermediate_size}, vocab {ours.hf_config.vocab_size}), seq_len {cfg.data.seq_len}, "
                f"{cfg.train.micro_batch_size} x {ours.layout.accum_steps} sequences/step, "
                f"{ours.flops_per_token / 1e6:.1f} MFLOP/token, {ours.precision}")
        C.timed_block(ours, 1, device)
        model_shape_tflops(ours.hf_config, tokens, 0.2)
        achieved, square, shapes, mfu_square, mfu_shapes = [], [], [], [], []
        for order in C.pair_orders(args.pairs, ("train", "peak")):
            for side in order:
                if side == "train":
                    seconds = C.timed_block(ours, args.block_steps, device).wall_s
                    achieved.append(args.block_steps * ours.tokens_per_step * ours.flops_per_token / seconds / 1e12)
                else:
                    square.append(probe_cpu_matmul_tflops("fp32"))  # train.py's probe, one fresh measurement
                    shapes.append(model_shape_tflops(ours.hf_config, tokens, args.probe_seconds))
            mfu_square.append(achieved[-1] / square[-1])
            mfu_shapes.append(achieved[-1] / shapes[-1])
        ours.close()
    return {"desc": desc, "achieved_tflops": achieved, "square_tflops": square, "shape_tflops": shapes,
            "mfu_square": C.ratio_stats(mfu_square), "mfu_shapes": C.ratio_stats(mfu_shapes),
            "tokens_per_sec": [a * 1e12 / ours.flops_per_token for a in achieved]}


def gpu_run(args, ds_config: str, report) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench_mfu_gpu_", dir=args.run_dir) as tmp:
        cmd = [sys.executable, "train.py", args.recipe, f"out_dir={tmp}", f"data.path={args.data}",
               f"distributed.deepspeed_config={ds_config}", f"train.max_steps={args.steps}", "train.eval_every_steps=0",
               "checkpoint.every_steps=0", "checkpoint.export_at_end=false", "logging.trackers=[]",
               "logging.progress_bar=false", "logging.log_every_steps=5", *args.overrides]
        report.line(f"  {' '.join(cmd[1:])}")
        proc = subprocess.run(cmd, cwd=C.ROOT, env={**os.environ, "ACCELERATE_DISABLE_RICH": "1"}, capture_output=True, text=True)
        if proc.returncode != 0:
            report.line(f"  FAILED ({proc.returncode}): {proc.stderr[-3000:]}")
            return {"failed": proc.returncode}
        rows = [json.loads(line) for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "tokens_per_sec" in r and r["step"] > args.warmup_steps]
    return {"tokens_per_sec": statistics.median(r["tokens_per_sec"] for r in rows),
            "mfu": statistics.median(r["mfu"] for r in rows), "peak_mem_gb": max(r["peak_mem_gb"] for r in rows),
            "step_time_s": statistics.median(r["step_time_s"] for r in rows)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS), help="CPU models (default: both)")
    parser.add_argument("--data", default="data/stdlib", help="prepared data folder (default: %(default)s)")
    parser.add_argument("--block-steps", type=int, default=1, help="CPU: training steps per timed block (default: %(default)s)")
    parser.add_argument("--probe-seconds", type=float, default=0.5,
                        help="CPU: seconds of the model-shape probe (default: %(default)s)")
    parser.add_argument("--recipe", default="recipes/llama_1b.yaml", help="GPU: recipe (default: %(default)s)")
    parser.add_argument("--ds-configs", nargs="+", default=["ds_configs/zero2.json"], help="GPU: DeepSpeed JSONs to run")
    parser.add_argument("--overrides", nargs="*", default=["model.vocab_size=128256", "train.global_batch_size=64"],
                        help="GPU: key=value overrides (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=40, help="GPU: optimizer steps per run (default: %(default)s)")
    parser.add_argument("--warmup-steps", type=int, default=10, help="GPU: metrics rows up to this step are left out")
    parser.add_argument("--run-dir", default=None, help="GPU: where the runs' folders go (their final checkpoint is large)")
    parser.add_argument("--worker", choices=list(MODELS), help=argparse.SUPPRESS)
    C.add_common_args(parser, pairs=3)
    args = parser.parse_args()
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    C.set_threads(args.threads)
    if args.worker:
        with C.quiet_stdout():
            result = cpu_worker(args)
        C.print_result(result)
        return 0
    C.check_data(args.data)
    report = C.Report("mfu" if args.device == "cpu" else "mfu_gpu", args.device, args.output)

    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no GPU visible")
        report.line(f"GPU: {torch.cuda.get_device_name(0)}; recipe {args.recipe} {' '.join(args.overrides)}, {args.steps} steps; "
                    f"figures: median of train.py's metrics rows after step {args.warmup_steps}")
        for ds_config in args.ds_configs:
            result = gpu_run(args, ds_config, report)
            report.figures[ds_config] = result
            if "failed" not in result:
                report.line(f"  {Path(ds_config).stem}: {result['tokens_per_sec']:,.0f} tokens/s, "
                            f"MFU {100 * result['mfu']:.1f}%, step {result['step_time_s']:.2f}s, "
                            f"peak memory {result['peak_mem_gb']:.1f} GB   "
                            f"target >= 45%: {'MET' if result['mfu'] >= 0.45 else 'MISSED'}")
        report.save()
        return 0

    for name in args.models:
        cmd = [sys.executable, __file__, "--worker", name, "--data", args.data, "--pairs", str(args.pairs),
               "--block-steps", str(args.block_steps), "--probe-seconds", str(args.probe_seconds), "--device", "cpu"]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        r = C.run_worker(cmd, name, {**os.environ, "ACCELERATE_DISABLE_RICH": "1"})
        report.figures[name] = r
        report.line(r["desc"])
        for i in range(len(r["achieved_tflops"])):
            report.line(f"  pair {i + 1}: achieved {1000 * r['achieved_tflops'][i]:.1f} GFLOP/s "
                        f"({r['tokens_per_sec'][i]:,.0f} tok/s), peak square {1000 * r['square_tflops'][i]:.1f}, "
                        f"at model shapes {1000 * r['shape_tflops'][i]:.1f} GFLOP/s")
        report.line(f"  MFU vs square-matmul peak (train.py's): {C.fmt_ratio(r['mfu_square'], '')}")
        report.line(f"  MFU vs model-shape GEMM peak:           {C.fmt_ratio(r['mfu_shapes'], '')}")
    report.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
