"""Data path: what the memmap loader delivers against what a training step consumes, and data_time_s in a real run.

Three parts (docs/benchmarks/03-data-path.md): the loader alone against ``_common.OursLoop`` in alternating blocks;
a ``train.py`` run of --run-steps steps (data_time_s / step_time_s, target < 1%); the loader at the 1B recipe's shape.
"""

import json
import tempfile
import time
from pathlib import Path

import _common as C

PAIRS = 6
DEVICE = True


def options(parser) -> None:
    parser.add_argument("--overrides", nargs="*", default=[], help="key=value recipe overrides of both parts")
    parser.add_argument("--block-steps", type=int, default=5, help="training steps per timed block (default: %(default)s)")
    parser.add_argument("--loader-steps", type=int, default=200, help="loader-only steps per block (default: %(default)s)")
    parser.add_argument("--run-steps", type=int, default=60, help="steps of the train.py run; 0 skips it (default: %(default)s)")


def loader_block(train_batches, first_step: int, n_steps: int, device) -> tuple[float, int]:
    """Seconds to fetch every micro-batch of ``n_steps`` steps (as the loop does), and how many there were."""
    count, start = 0, time.perf_counter()
    for step in range(first_step, first_step + n_steps):
        for inputs, targets, _ in train_batches.micro_batches(step):
            inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
            count += 1
    C.sync(device)
    return time.perf_counter() - start, count


def run(args, report) -> None:
    in_process(args, report)
    if args.run_steps:
        real_run(args, report)
    from lmrecipe.data.batches import BatchLayout, TrainBatches
    from lmrecipe.data.format import TokenWindows

    big = TokenWindows(args.data, "train", 2048)
    if len(big) >= 8:
        seconds, count = loader_block(TrainBatches(big, BatchLayout(8 * 4, 8, 1, 0), 0), 0, 20, "cpu")
        report.line(f"3. loader alone at seq_len 2048, micro-batch 8 (the 1B recipe's shape): "
                    f"{count / seconds:,.0f} micro-batches/s = {count * 8 * 2048 / seconds / 1e6:,.1f}M tokens/s, "
                    f"from {len(big)} windows (page cache warm)")
        report.figures["loader_seq2048_micro8_batches_per_sec"] = count / seconds


def in_process(args, report) -> None:
    from lmrecipe.data.batches import TrainBatches

    with C.ours_loop(args.recipe, args.overrides, args.data) as ours:
        cfg, device = ours.cfg, ours.device
        # The loader under test reads other steps than the loop, so neither finds the other's pages just touched.
        loader = TrainBatches(ours.train_batches.windows, ours.layout, cfg.train.seed + 1)
        report.line(f"1. in-process, {args.recipe} {' '.join(args.overrides)}: micro-batch {cfg.train.micro_batch_size} "
                    f"x seq_len {cfg.data.seq_len}, accumulation {ours.layout.accum_steps}, device {device}")
        C.timed_block(ours, 2)
        loader_block(loader, 0, 10, device)
        next_step = iter(range(10, 10**9, args.loader_steps))

        def measure(side: str) -> dict:
            if side == "loader":
                seconds, count = loader_block(loader, next(next_step), args.loader_steps, device)
                return {"rate": count / seconds}
            ours.sections.clear()
            seconds = C.timed_block(ours, args.block_steps).wall_s
            return {"rate": args.block_steps * ours.layout.accum_steps / seconds, "share": ours.sections["data"] / seconds}

        got, stats = C.interleave(report, args.pairs, ("loader", "training"), measure,
                                  {"headroom": lambda g: g["loader"]["rate"] / g["training"]["rate"]},
                                  lambda g: (f"loader {g['loader']['rate']:,.0f} micro-batches/s, training consumes "
                                             f"{g['training']['rate']:,.2f}/s, fetch share of the training block "
                                             f"{100 * g['training']['share']:.3f}%"))
    shares = C.ratio_stats([g["share"] for g in got["training"]])
    report.line(f"loader / training micro-batches per second: {C.fmt_ratio(stats['headroom'])}")
    report.line(f"fetch share of step time, in-process: {100 * shares['median']:.3f}% ({100 * shares['min']:.3f}-"
                f"{100 * shares['max']:.3f}%)")
    report.figures.update(headroom_loader_over_training=stats["headroom"], fetch_share_in_process=shares,
                          rates={side: [g["rate"] for g in rows] for side, rows in got.items()})


def real_run(args, report) -> None:
    with tempfile.TemporaryDirectory(prefix="bench_data_run_") as out_dir:
        cmd = C.train_command(args.recipe, out_dir, args.data, [f"train.max_steps={args.run_steps}",
                                                                "logging.log_every_steps=10", *args.overrides])
        C.run_checked(cmd, **({"OMP_NUM_THREADS": str(args.threads)} if args.threads else {}))
        rows = [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in rows if "step_time_s" in r and r["step"] > 1]  # step 1 alone is start-up, not steady state
    total = sum(r["data_time_s"] for r in timed) / sum(r["step_time_s"] for r in timed)
    row_stats = C.ratio_stats([r["data_time_s"] / r["step_time_s"] for r in timed])
    report.line(f"2. real run: {' '.join(cmd[1:])}")
    for r in timed:
        report.line(f"  step {r['step']:>4}: step_time_s {r['step_time_s']:.4f}  data_time_s {r['data_time_s']:.6f}  "
                    f"share {100 * r['data_time_s'] / r['step_time_s']:.3f}%  ({r['tokens_per_sec']:,.0f} tok/s)")
    report.line(f"data_time_s / step_time_s: rows' median {100 * row_stats['median']:.3f}% ({100 * row_stats['min']:.3f}-"
                f"{100 * row_stats['max']:.3f}%); over the run {100 * total:.3f}%, target < 1%: "
                f"{'MET' if total < 0.01 else 'MISSED'}")
    report.figures["real_run"] = {"command": " ".join(cmd[1:]), "share_per_row": row_stats, "share_total": total, "rows": timed}

