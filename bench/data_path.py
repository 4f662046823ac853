"""Data path: what the memmap loader delivers against what a training step consumes, and data_time_s in a real run.

    .venv/bin/python bench/data_path.py                      # tiny recipe: loader vs training, then a 60-step train.py run
    .venv/bin/python bench/data_path.py --pairs 10 --run-steps 200
    .venv/bin/python bench/data_path.py --device cuda --recipe recipes/llama_125m.yaml --overrides data.path=data/stdlib

1. In one process, alternating blocks (A B, B A, ...): the loader alone (TrainBatches.micro_batches, with the
   .to(device) of the loop) for --loader-steps optimizer steps, and the training loop (bench/_common.py: OursLoop,
   the body of lmrecipe.train) for --block-steps steps. Per pair: loader micro-batches/s over the
   micro-batches/s training consumes (the headroom; its inverse is the share of step time the fetch would take
   without overlap), and the fetch's measured share of the training block's time.
2. A real `train.py` run (subprocess) of --run-steps steps: data_time_s / step_time_s from its metrics.jsonl.
3. Loader-only micro-batches/s at the 1B recipe's shape (seq_len 2048, micro-batch 8), for GPU budgets.
4. TokenWindows.batch (one fancy index into a plain ndarray view of the map) against the per-window stacking
   it replaced, checked to return the same tensors, interleaved.
Target: data_time_s < 1% of step time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _common as C  # noqa: E402


def loader_block(train_batches, first_step: int, n_steps: int, device) -> tuple[float, int]:
    """Seconds to fetch every micro-batch of ``n_steps`` steps (as the loop does), and how many there were."""
    count = 0
    start = time.perf_counter()
    for step in range(first_step, first_step + n_steps):
        for inputs, targets, _ in train_batches.micro_batches(step):
            inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
            count += 1
    C.sync(device)
    return time.perf_counter() - start, count


def real_run(args, out_dir: str) -> tuple[list[dict], str]:
    cmd = [sys.executable, "train.py", args.recipe, f"out_dir={out_dir}", f"data.path={args.data}",
           f"train.max_steps={args.run_steps}", "train.eval_every_steps=0", "checkpoint.every_steps=0",
           "checkpoint.export_at_end=false", "logging.progress_bar=false", "logging.trackers=[]", "logging.log_every_steps=10",
           *args.run_overrides]
    env = {**os.environ, "ACCELERATE_DISABLE_RICH": "1"}
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    proc = subprocess.run(cmd, cwd=C.ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"train.py failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    rows = [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "step_time_s" in r], " ".join(cmd[1:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="recipes/tiny.yaml")
    parser.add_argument("--overrides", nargs="*", default=[], help="key=value overrides of the in-process part (default: none)")
    parser.add_argument("--run-overrides", nargs="*", default=[], help="key=value overrides of the train.py run (default: none)")
    parser.add_argument("--data", default="data/stdlib", help="prepared data folder (default: %(default)s)")
    parser.add_argument("--block-steps", type=int, default=5, help="training steps per timed block (default: %(default)s)")
    parser.add_argument("--loader-steps", type=int, default=200, help="loader-only steps per timed block (default: %(default)s)")
    parser.add_argument("--run-steps", type=int, default=60,
                        help="steps of the real train.py run; 0 skips it (default: %(default)s)")
    C.add_common_args(parser, pairs=6)
    args = parser.parse_args()
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    C.set_threads(args.threads)
    C.check_data(args.data)
    report = C.Report("data_path", args.device, args.output)

    from lmrecipe.data.batches import BatchLayout, TrainBatches
    from lmrecipe.data.format import TokenWindows

    with tempfile.TemporaryDirectory(prefix="bench_data_") as tmp:
        cfg = C.bench_config(args.recipe, args.overrides, out_dir=tmp, data_path=args.data)
        ours = C.OursLoop(cfg, Path(tmp))
        device = ours.accelerator.device
        # The loader under test reads other steps than the loop, so neither finds the other's pages just touched.
        loader = TrainBatches(ours.train_batches.windows, ours.layout, cfg.train.seed + 1)
        report.line(f"1. in-process, recipe {args.recipe} {' '.join(args.overrides)}: micro-batch {cfg.train.micro_batch_size} x "
                    f"seq_len {cfg.data.seq_len}, accumulation {ours.layout.accum_steps}, device {device}")
        C.timed_block(ours, 2, device)
        loader_block(loader, 0, 10, device)
        headroom, shares, rates = [], [], {"loader": [], "training": []}
        loader_step = 10
        for i, order in enumerate(C.pair_orders(args.pairs, ("loader", "training"))):
            for side in order:
                if side == "loader":
                    seconds, count = loader_block(loader, loader_step, args.loader_steps, device)
                    loader_step += args.loader_steps
                    rates["loader"].append(count / seconds)
                else:
                    ours.sections.reset()
                    seconds = C.timed_block(ours, args.block_steps, device).wall_s
                    rates["training"].append(args.block_steps * ours.layout.accum_steps / seconds)
                    shares.append(ours.sections.seconds["data"] / seconds)
            headroom.append(rates["loader"][-1] / rates["training"][-1])
            report.line(f"pair {i + 1} ({' '.join(order)}): loader {rates['loader'][-1]:,.0f} micro-batches/s, "
                        f"training consumes {rates['training'][-1]:,.2f}/s: headroom {headroom[-1]:,.0f}x; "
                        f"fetch share of the training block {100 * shares[-1]:.3f}%")
        ours.close()
    stats = C.ratio_stats(headroom)
    share_stats = C.ratio_stats(shares)
    report.line(f"loader / training micro-batches per second: {C.fmt_ratio(stats)}")
    report.line(f"fetch share of step time, in-process: median {100 * share_stats['median']:.3f}% "
                f"(min {100 * share_stats['min']:.3f}%, max {100 * share_stats['max']:.3f}%)")
    report.figures = {"headroom_loader_over_training": stats, "fetch_share_in_process": share_stats, "rates": rates}

    if args.run_steps:
        with tempfile.TemporaryDirectory(prefix="bench_data_run_") as tmp:
            rows, cmd = real_run(args, tmp)
        report.line()
        report.line(f"2. real run: {cmd}")
        timed = [r for r in rows if r["step"] > 1]  # the first row is step 1 alone: start-up, not steady state
        per_row = [r["data_time_s"] / r["step_time_s"] for r in timed]
        total = sum(r["data_time_s"] for r in timed) / sum(r["step_time_s"] for r in timed)
        row_stats = C.ratio_stats(per_row)
        for r in timed:
            report.line(f"  step {r['step']:>4}: step_time_s {r['step_time_s']:.4f}  data_time_s {r['data_time_s']:.6f}  "
                        f"share {100 * r['data_time_s'] / r['step_time_s']:.3f}%  ({r['tokens_per_sec']:,.0f} tok/s)")
        report.line(f"data_time_s / step_time_s over rows: median {100 * row_stats['median']:.3f}% "
                    f"(min {100 * row_stats['min']:.3f}%, max {100 * row_stats['max']:.3f}%); over the run {100 * total:.3f}%   "
                    f"target < 1%: {'MET' if total < 0.01 else 'MISSED'}")
        report.figures["real_run"] = {"command": cmd, "share_per_row": row_stats, "share_total": total, "rows": timed}

    big = TokenWindows(args.data, "train", 2048)
    if len(big) >= 8:
        layout = BatchLayout(8 * 4, 8, 1, 0)
        seconds, count = loader_block(TrainBatches(big, layout, 0), 0, 20, "cpu")
        report.line()
        report.line(f"3. loader alone at seq_len 2048, micro-batch 8 (the 1B recipe's shape): "
                    f"{count / seconds:,.0f} micro-batches/s = {count * 8 * 2048 / seconds / 1e6:,.1f}M tokens/s, "
                    f"from {len(big)} windows (page cache warm)")
        report.figures["loader_seq2048_micro8_batches_per_sec"] = count / seconds
    report.line()
    report.figures["gather_vs_stacking"] = gather_vs_stacking(args, report)
    report.save()
    return 0


def gather_vs_stacking(args, report) -> dict:
    """TokenWindows.batch (one fancy index into a plain ndarray view of the map) against the gather it replaced:
    one np.memmap slice per window, checked, then np.stack."""
    import numpy as np
    import torch

    from lmrecipe.data.batches import BatchLayout, TrainBatches
    from lmrecipe.data.format import TokenWindows

    windows = TokenWindows(args.data, "train", 128)
    batches = TrainBatches(windows, BatchLayout(8, 8, 1, 0), 0)
    L = windows.seq_len

    def stacking(ids):  # the earlier TokenWindows.window + stack_windows
        rows = []
        for i in ids:
            tokens = windows.tokens[i * L : i * L + L + 1]
            if len(tokens) and int(tokens.max()) > windows.max_token_id:
                raise AssertionError(i)
            rows.append(tokens)
        rows = np.stack(rows).astype(np.int64)
        return torch.from_numpy(rows[:, :-1]), torch.from_numpy(rows[:, 1:])

    ids = [batches.window_ids(step, 0) for step in range(500)]
    for i in ids[:20]:
        a, b = windows.batch(i), stacking(i)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    per_call = {"stacking": [], "gather": []}
    for order in C.pair_orders(args.pairs, ("stacking", "gather")):
        for side in order:
            fn = windows.batch if side == "gather" else stacking
            start = time.perf_counter()
            for i in ids:
                fn(i)
            per_call[side].append((time.perf_counter() - start) / len(ids))
    ratios = [s / g for s, g in zip(per_call["stacking"], per_call["gather"])]
    stats = C.ratio_stats(ratios)
    import statistics

    stacking_us, gather_us = (1e6 * statistics.median(per_call[k]) for k in ("stacking", "gather"))
    report.line(f"4. micro-batch 8 x seq_len 128: TokenWindows.batch (one fancy index) {gather_us:.0f} us/call, "
                f"the earlier per-window memmap slices + np.stack {stacking_us:.0f} us/call (same tensors, both "
                f"checked against max_token_id): {C.fmt_ratio(stats)} faster")
    return {"stacking_us": stacking_us, "gather_us": gather_us, "speedup": stats}

if __name__ == "__main__":
    sys.exit(main())
