"""MFU on a CPU: achieved training FLOP/s over the measured matmul peak, for the tiny recipe and a 512-wide 8-layer model.

Each model in its own process, blocks of --block-steps training steps (``_common.OursLoop``) alternating with the
1024 x 1024 fp32 matmul probe whose peak train.py's MFU uses (docs/benchmarks/05-mfu.md; on a GPU: the GPU kit).
"""

import _common as C

RECIPE = None
MODELS = {  # overrides of recipes/tiny.yaml
    "tiny": [],
    "large": ["model.hidden_size=512", "model.num_layers=8", "model.num_heads=8", "model.intermediate_size=null",
              "data.seq_len=256", "train.global_batch_size=16", "train.micro_batch_size=8"],
}


def options(parser) -> None:
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS), help="models (default: both)")
    parser.add_argument("--block-steps", type=int, default=1, help="training steps per timed block (default: %(default)s)")


def worker(args) -> dict:
    from lmrecipe.observe.device import probe_cpu_matmul_tflops

    name = args.models[0]
    with C.ours_loop("recipes/tiny.yaml", MODELS[name], args.data) as ours:
        cfg = ours.cfg
        desc = (f"{name}: {ours.n_params / 1e6:.1f}M params ({cfg.model.num_layers} layers x {cfg.model.hidden_size}, "
                f"vocab {ours.hf_config.vocab_size}), seq_len {cfg.data.seq_len}, {cfg.train.micro_batch_size} x "
                f"{ours.layout.accum_steps} sequences/step, {ours.flops_per_token / 1e6:.1f} MFLOP/token, {ours.precision}")
        C.timed_block(ours, 1)
        achieved, peak = [], []
        for order in C.pair_orders(args.pairs, ("train", "peak")):
            for side in order:
                if side == "peak":
                    peak.append(probe_cpu_matmul_tflops("fp32"))
                else:
                    seconds = C.timed_block(ours, args.block_steps).wall_s
                    achieved.append(args.block_steps * ours.tokens_per_step * ours.flops_per_token / seconds / 1e12)
    return {"desc": desc, "achieved_tflops": achieved, "square_tflops": peak,
            "mfu_square": C.ratio_stats([a / p for a, p in zip(achieved, peak)]),
            "tokens_per_sec": [a * 1e12 / ours.flops_per_token for a in achieved]}


def run(args, report) -> None:
    for name in args.models:
        r = C.run_worker(C.worker_command(args, "cpu", "--models", name), name, CUDA_VISIBLE_DEVICES="")
        report.figures[name] = r
        report.line(r["desc"])
        for i, (achieved, peak) in enumerate(zip(r["achieved_tflops"], r["square_tflops"]), start=1):
            report.line(f"  round {i}: achieved {1000 * achieved:.1f} GFLOP/s ({r['tokens_per_sec'][i - 1]:,.0f} tok/s), "
                        f"peak {1000 * peak:.1f} GFLOP/s")
        report.line(f"  MFU: {C.fmt_ratio(r['mfu_square'], '')}")
