"""MFU on a CPU: achieved training FLOP/s over a measured matmul peak, for the tiny recipe and a 512-wide 8-layer model.

Each model in its own process, alternating a training block of --block-steps steps (``_common.OursLoop``) with two
peak probes: *square*, ``lmrecipe.observe.device.cpu_matmul_tflops``'s 1024 x 1024 fp32 probe (the peak train.py's
MFU uses), and *model shapes*, every Linear GEMM of one micro-step at the model's own sizes (forward X W^T, backward
dY W and dY^T X), FLOP-weighted. Achieved FLOP/s = ``flops_per_token`` x tokens/s. Each round gives achieved / peak;
the figure is their median with min and max. The GPU figure is the GPU kit's (``bench/gpu/run.py``, stage mfu_zero2).
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import _common as C

RECIPE = None
MODELS = {
    "tiny": ["recipes/tiny.yaml", []],
    "large": ["recipes/tiny.yaml", ["model.hidden_size=512", "model.num_layers=8", "model.num_heads=8",
                                    "model.intermediate_size=null", "data.seq_len=256", "train.global_batch_size=16",
                                    "train.micro_batch_size=8"]],
}


def options(parser) -> None:
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS), help="models (default: both)")
    parser.add_argument("--block-steps", type=int, default=1, help="training steps per timed block (default: %(default)s)")
    parser.add_argument("--probe-seconds", type=float, default=0.5,
                        help="seconds of the model-shape probe (default: %(default)s)")


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


def worker(args) -> dict:
    from lmrecipe.observe.device import probe_cpu_matmul_tflops

    name = args.models[0]
    recipe, overrides = MODELS[name]
    with tempfile.TemporaryDirectory(prefix="bench_mfu_") as tmp:
        cfg = C.bench_config(recipe, overrides, out_dir=tmp, data_path=args.data)
        ours = C.OursLoop(cfg, Path(tmp))
        device, tokens = ours.accelerator.device, cfg.train.micro_batch_size * cfg.data.seq_len
        desc = (f"{name}: {ours.n_params / 1e6:.1f}M params ({cfg.model.num_layers} layers x {cfg.model.hidden_size}, "
                f"mlp {ours.hf_config.intermediate_size}, vocab {ours.hf_config.vocab_size}), seq_len {cfg.data.seq_len}, "
                f"{cfg.train.micro_batch_size} x {ours.layout.accum_steps} sequences/step, "
                f"{ours.flops_per_token / 1e6:.1f} MFLOP/token, {ours.precision}")
        C.timed_block(ours, 1, device)
        model_shape_tflops(ours.hf_config, tokens, 0.2)
        achieved, square, shapes = [], [], []
        for order in C.pair_orders(args.pairs, ("train", "peak")):
            for side in order:
                if side == "train":
                    seconds = C.timed_block(ours, args.block_steps, device).wall_s
                    achieved.append(args.block_steps * ours.tokens_per_step * ours.flops_per_token / seconds / 1e12)
                else:
                    square.append(probe_cpu_matmul_tflops("fp32"))  # train.py's probe, one fresh measurement
                    shapes.append(model_shape_tflops(ours.hf_config, tokens, args.probe_seconds))
        ours.close()
    return {"desc": desc, "achieved_tflops": achieved, "square_tflops": square, "shape_tflops": shapes,
            "mfu_square": C.ratio_stats([a / p for a, p in zip(achieved, square)]),
            "mfu_shapes": C.ratio_stats([a / p for a, p in zip(achieved, shapes)]),
            "tokens_per_sec": [a * 1e12 / ours.flops_per_token for a in achieved]}


def run(args, report) -> None:
    for name in args.models:
        r = C.run_worker(C.worker_command(args, "cpu", "--models", name), name,
                         {**os.environ, "ACCELERATE_DISABLE_RICH": "1", "CUDA_VISIBLE_DEVICES": ""})  # CPU figures
        report.figures[name] = r
        report.line(r["desc"])
        for i in range(len(r["achieved_tflops"])):
            report.line(f"  pair {i + 1}: achieved {1000 * r['achieved_tflops'][i]:.1f} GFLOP/s "
                        f"({r['tokens_per_sec'][i]:,.0f} tok/s), peak square {1000 * r['square_tflops'][i]:.1f}, "
                        f"at model shapes {1000 * r['shape_tflops'][i]:.1f} GFLOP/s")
        report.line(f"  MFU vs square-matmul peak (train.py's): {C.fmt_ratio(r['mfu_square'], '')}")
        report.line(f"  MFU vs model-shape GEMM peak:           {C.fmt_ratio(r['mfu_shapes'], '')}")
