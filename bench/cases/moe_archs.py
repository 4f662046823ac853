"""Tokens/s of the tiny DeepSeek-V3 and Qwen3.5-MoE recipes against the tiny Qwen3-MoE recipe, on this CPU.

Each recipe trains in its own process (``_common.OursLoop``: the trainer's own step, one process, no DeepSpeed) at
the same window, batch and steps (``--set`` overrides all three); after one warm-up block, the processes run in
turn, one block of ``--block-steps`` steps each per round, in alternating orders (``--pairs`` rounds). The figure is
each recipe's tokens/s over Qwen3-MoE's in the same round: median, min and max. Qwen3.5-MoE's linear attention runs
transformers' torch fallback here (no flash-linear-attention, no causal-conv1d on a CPU).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import _common as C

PAIRS = 3
RECIPE = None
RECIPES = {"qwen3_moe": "recipes/tiny_moe.yaml", "deepseek_v3": "recipes/tiny_deepseek_v3.yaml",
           "qwen3_5_moe": "recipes/tiny_qwen3_5_moe.yaml"}
SAME = ["data.seq_len=64", "train.global_batch_size=16", "train.micro_batch_size=8", "data.document_masking=false",
        "logging.plots=false", "logging.log_every_steps=1000000"]


def options(parser) -> None:
    parser.add_argument("--block-steps", type=int, default=5, help="training steps per timed block (default: %(default)s)")
    parser.add_argument("--recipe-name", choices=list(RECIPES), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="an override for every recipe")


def worker(args) -> dict:
    """One recipe's process: a warm-up block, then on each line of stdin a timed block (the parent's turn)."""
    import sys

    name = args.recipe_name
    with tempfile.TemporaryDirectory(prefix="bench_moe_archs_") as tmp:
        cfg = C.bench_config(RECIPES[name], [*SAME, *args.set], out_dir=tmp, data_path=args.data)
        ours = C.OursLoop(cfg, Path(tmp))
        device = ours.accelerator.device
        C.timed_block(ours, 1, device)
        desc = (f"{name} ({RECIPES[name]}): {ours.n_params / 1e6:.2f}M params, {ours.tokens_per_step} tokens per step, "
                f"{ours.flops_per_token / 1e6:.2f} MFLOP/token")
        _say({"ready": desc})
        seconds = []
        for line in sys.stdin:
            if line.strip() != "block":
                break
            seconds.append(C.timed_block(ours, args.block_steps, device).wall_s)
            _say({"seconds": seconds[-1]})
        ours.close()
    return {"desc": desc, "seconds": seconds, "tokens_per_step": ours.tokens_per_step}


def _say(result: dict) -> None:
    """A result line to the parent while the runner swallows the worker's stdout (``_common.quiet_stdout``)."""
    import json
    import sys

    print(C.RESULT_PREFIX + json.dumps(result), file=sys.__stdout__, flush=True)


def run(args, report) -> None:
    import json
    import subprocess

    env = {**os.environ, "ACCELERATE_DISABLE_RICH": "1", "CUDA_VISIBLE_DEVICES": ""}
    workers = {}
    for name in RECIPES:
        cmd = C.worker_command(args, "cpu", "--recipe-name", name)
        workers[name] = subprocess.Popen(cmd, cwd=C.ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=subprocess.DEVNULL, text=True, bufsize=1)

    def reply(name: str) -> dict:
        for line in workers[name].stdout:
            if line.startswith(C.RESULT_PREFIX):
                return json.loads(line[len(C.RESULT_PREFIX):])
        raise SystemExit(f"{name} worker ended without a result (run it alone: {' '.join(workers[name].args)})")

    descs = {name: reply(name)["ready"] for name in RECIPES}
    for desc in descs.values():
        report.line(desc)
    tokens_per_block = {}
    seconds: dict[str, list[float]] = {name: [] for name in RECIPES}
    for round_, order in enumerate(C.pair_orders(args.pairs, tuple(RECIPES))):
        for name in order:
            workers[name].stdin.write("block\n")
            seconds[name].append(reply(name)["seconds"])
        report.line(f"round {round_ + 1} ({', '.join(order)}): " + ", ".join(
            f"{n} {s[-1]:.2f} s" for n, s in seconds.items()))
    results = {}
    for name, proc in workers.items():
        proc.stdin.write("done\n")
        proc.stdin.close()
        results[name] = reply(name)
        proc.wait()
        tokens_per_block[name] = results[name]["tokens_per_step"] * args.block_steps
    tokens = {n: [tokens_per_block[n] / s for s in seconds[n]] for n in RECIPES}
    report.line()
    report.line(f"| recipe | tokens/s (median of {args.pairs} rounds of {args.block_steps} steps) | over qwen3_moe "
                "(median, min, max of the rounds) |")
    report.line("| --- | ---: | ---: |")
    stats = {}
    for name in RECIPES:
        stats[name] = C.ratio_stats([t / q for t, q in zip(tokens[name], tokens["qwen3_moe"])])
        report.line(f"| {name} | {statistics.median(tokens[name]):,.0f} | {C.fmt_ratio(stats[name])} |")
    report.figures = {"block_steps": args.block_steps, "tokens_per_sec": tokens, "over_qwen3_moe": stats,
                      "descs": descs, "measured_at": time.strftime("%Y-%m-%d %H:%M:%S")}
