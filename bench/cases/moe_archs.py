"""Tokens/s of the tiny DeepSeek-V3 and Qwen3.5-MoE recipes against the tiny Qwen3-MoE recipe, on this CPU.

Each recipe trains in its own process (``_common.OursLoop``) at the same window and batch (``--set`` overrides all
of them); after a warm-up block the processes take turns, a block of --block-steps steps each per round, in rotated
orders. The figure: each recipe's tokens/s over Qwen3-MoE's in the same round. Qwen3.5-MoE's linear attention runs
transformers' torch fallback here (no flash-linear-attention on a CPU).
"""

import argparse
import os
import statistics
import subprocess
import sys

import _common as C

RECIPE = None
RECIPES = {"qwen3_moe": "recipes/tiny_moe.yaml", "deepseek_v3": "recipes/tiny_deepseek_v3.yaml",
           "qwen3_5_moe": "recipes/tiny_qwen3_5_moe.yaml"}
SAME = ["data.seq_len=64", "train.global_batch_size=16", "train.micro_batch_size=8", "data.document_masking=false",
        "logging.plots=false", "logging.log_every_steps=1000000"]


def options(parser) -> None:
    parser.add_argument("--block-steps", type=int, default=5, help="training steps per timed block (default: %(default)s)")
    parser.add_argument("--recipe-name", choices=list(RECIPES), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="an override for every recipe")


def worker(args) -> None:
    """One recipe's process: a warm-up block, then a timed block for each ``block`` line on stdin (the parent's turn);
    its replies go to the real stdout, past the runner's ``quiet_stdout``."""
    name = args.recipe_name
    with C.ours_loop(RECIPES[name], [*SAME, *args.set], args.data) as ours:
        C.timed_block(ours, 1)
        C.print_result({"ready": f"{name} ({RECIPES[name]}): {ours.n_params / 1e6:.2f}M params, {ours.tokens_per_step} "
                                 f"tokens per step, {ours.flops_per_token / 1e6:.2f} MFLOP/token",
                        "tokens_per_step": ours.tokens_per_step}, sys.__stdout__)
        for line in sys.stdin:
            if line.strip() != "block":
                break
            C.print_result({"seconds": C.timed_block(ours, args.block_steps).wall_s}, sys.__stdout__)


def run(args, report) -> None:
    env = {**os.environ, "ACCELERATE_DISABLE_RICH": "1", "CUDA_VISIBLE_DEVICES": ""}
    workers = {name: subprocess.Popen(C.worker_command(args, "cpu", "--recipe-name", name), cwd=C.ROOT, env=env,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                      text=True, bufsize=1) for name in RECIPES}

    def reply(name: str) -> dict:
        result = C.read_result(workers[name].stdout)
        if result is None:
            raise SystemExit(f"{name} worker ended without a result (run it alone: {' '.join(workers[name].args)})")
        return result

    def measure(name: str) -> float:
        workers[name].stdin.write("block\n")
        return reply(name)["seconds"]

    ready = {name: reply(name) for name in RECIPES}
    for got in ready.values():
        report.line(got["ready"])
    tokens_s = {n: lambda g, n=n: ready[n]["tokens_per_step"] * args.block_steps / g[n] for n in RECIPES}
    seconds, stats = C.interleave(report, args.pairs, tuple(RECIPES), measure,
                                  {n: lambda g, n=n: tokens_s[n](g) / tokens_s["qwen3_moe"](g) for n in RECIPES},
                                  lambda g: ", ".join(f"{n} {s:.2f} s" for n, s in g.items()))
    for proc in workers.values():
        proc.stdin.close()
        proc.wait()
    tokens = {n: [ready[n]["tokens_per_step"] * args.block_steps / s for s in seconds[n]] for n in RECIPES}
    report.line()
    report.table(["recipe", f"tokens/s (median of {args.pairs} rounds of {args.block_steps} steps)",
                  "over qwen3_moe (median, min, max of the rounds)"],
                 [[name, f"{statistics.median(tokens[name]):,.0f}", C.fmt_ratio(stats[name])] for name in RECIPES])
    report.figures = {"block_steps": args.block_steps, "tokens_per_sec": tokens, "over_qwen3_moe": stats,
                      "descs": {n: got["ready"] for n, got in ready.items()}}
