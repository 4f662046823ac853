"""How long the training loop is blocked per checkpoint: synchronous writes against background writes, in one run.

    .venv/bin/python bench/checkpoint_stall.py --threads 1 --pairs 6
    .venv/bin/python bench/checkpoint_stall.py --threads 1 --pairs 4 --deepspeed ds_configs/zero2.json

One process, one model (``build_run`` of the recipe with --hidden-size / --layers; no DeepSpeed, or the DeepSpeed
config of --deepspeed on one process), two checkpointers built by the trainer's own ``build_checkpointer``: ``checkpoint.background_save``
false and true, each writing into its own folder. A round of one side is what the loop does around a save:

1. ``Checkpointer.maybe_save`` at a save step (timed: **save call**). Synchronous: the whole write, publication
   included. Background: the probe forward, the copy of the state to CPU memory and the small files; the model
   and optimizer files are written by the worker thread;
2. --steps-between training steps (``trainer.train_step``; timed: **steps**). With background writes these run while
   the write is in flight and share the CPU with it;
3. ``Checkpointer.wait`` (timed: **wait**): what the next save, a rollback or the end of the run would wait for if the
   write were still in flight (zero for the synchronous side).

The loop is blocked for save call + wait. Rounds alternate the sides (A B, B A, ...) after one warm-up round each;
each figure is the median of the per-round ratios sync / background, with min and max. A second ratio compares the
whole round (blocked time + steps), which also charges the background side for the CPU its writer thread takes.
Files are written as the trainer writes them (through the page cache; only ``train_state.json`` and the pointers
are fsynced), to --tmp (default: the system's temporary folder).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path

import _common as C  # noqa: E402

SIDES = ("sync", "background")


def folder_mb(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="recipes/tiny.yaml")
    parser.add_argument("--data", default="data/stdlib")
    parser.add_argument("--hidden-size", type=int, default=512, help="model width (default: %(default)s)")
    parser.add_argument("--layers", type=int, default=8, help="transformer blocks (default: %(default)s)")
    parser.add_argument("--steps-between", type=int, default=3, help="training steps after each save (default: %(default)s)")
    parser.add_argument("--deepspeed", default=None, help="a ds_configs JSON (default: no DeepSpeed)")
    parser.add_argument("--tmp", default=None, help="folder for the run and its checkpoints (default: system temp)")
    C.add_common_args(parser, pairs=6, device=False)
    args = parser.parse_args()
    C.check_data(args.data)
    C.set_threads(args.threads)

    import logging

    from lmrecipe.train.callbacks.checkpointing import build_checkpointer
    from lmrecipe.train.setup import build_run
    from lmrecipe.train.state import TrainState
    from lmrecipe.train.step import train_step

    logging.disable(logging.INFO)
    name = "checkpoint_stall" + (f"_{Path(args.deepspeed).stem}" if args.deepspeed else "")
    report = C.Report(name, "cpu", args.output)
    with tempfile.TemporaryDirectory(prefix="bench_ckpt_", dir=args.tmp) as tmp:
        cfg = C.bench_config(args.recipe, [f"model.hidden_size={args.hidden_size}", f"model.num_layers={args.layers}",
                                           f"model.intermediate_size={(8 * args.hidden_size // 3 + 63) // 64 * 64}",
                                           "checkpoint.every_steps=1", "checkpoint.keep_last=1",
                                           f"distributed.deepspeed_config={args.deepspeed or 'null'}"],
                             f"{tmp}/run", args.data)
        run = build_run(cfg, Path(tmp) / "run")
        checkpointers = {}
        for side in SIDES:
            side_cfg = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint,
                                                                                 background_save=side == "background"))
            checkpointers[side] = build_checkpointer(dataclasses.replace(run, cfg=side_cfg), Path(tmp) / side)
        state = TrainState()
        report.line(f"model {run.n_params / 1e6:.1f}M params, {run.runtime.topology.zero.describe()}, "
                    f"{run.tokens_per_step} tokens per step, "
                    f"{args.steps_between} steps between saves, threads {args.threads or 'default'}, files in {tmp}")

        def one_round(side: str) -> dict:
            checkpointer = checkpointers[side]
            start = time.perf_counter()
            checkpointer.maybe_save(run.model, state)
            save_s = time.perf_counter() - start
            steps_s = []
            for _ in range(args.steps_between):
                step_start = time.perf_counter()
                result = train_step(run, state.step)
                state.record_step(result.skipped, run.tokens_per_step)
                steps_s.append(time.perf_counter() - step_start)
            start = time.perf_counter()
            checkpointer.wait()
            wait_s = time.perf_counter() - start
            return {"save_s": save_s, "wait_s": wait_s, "blocked_s": save_s + wait_s, "steps_s": sum(steps_s),
                    "step_s": statistics.median(steps_s)}

        for _ in range(2):  # warm-up: the first steps, and one save of each side
            train_step(run, state.step)
            state.record_step(False, run.tokens_per_step)
        with C.quiet_stdout():
            for side in SIDES:
                one_round(side)
        size = folder_mb(checkpointers["sync"].latest)
        report.line(f"checkpoint size {size:,.0f} MB")

        rounds: dict[str, list[dict]] = {side: [] for side in SIDES}
        blocked_ratios, round_ratios = [], []
        for order in C.pair_orders(args.pairs, SIDES):
            with C.quiet_stdout():
                got = {side: one_round(side) for side in order}
            for side in SIDES:
                rounds[side].append(got[side])
            blocked_ratios.append(got["sync"]["blocked_s"] / got["background"]["blocked_s"])
            round_ratios.append((got["sync"]["blocked_s"] + got["sync"]["steps_s"])
                                / (got["background"]["blocked_s"] + got["background"]["steps_s"]))
            report.line(f"round {len(blocked_ratios)}: " + " | ".join(
                f"{side} save {1e3 * got[side]['save_s']:,.0f} ms + wait {1e3 * got[side]['wait_s']:,.0f} ms, "
                f"step {1e3 * got[side]['step_s']:,.0f} ms" for side in SIDES)
                + f" | blocked ratio {blocked_ratios[-1]:.2f}")

        def median(side: str, key: str) -> float:
            return statistics.median(r[key] for r in rounds[side])

        for side in SIDES:
            report.line(f"{side:>10}: loop blocked {1e3 * median(side, 'blocked_s'):,.0f} ms per checkpoint (save call "
                        f"{1e3 * median(side, 'save_s'):,.0f} ms, wait {1e3 * median(side, 'wait_s'):,.0f} ms); "
                        f"median training step after the save {1e3 * median(side, 'step_s'):,.0f} ms")
        blocked, whole = C.ratio_stats(blocked_ratios), C.ratio_stats(round_ratios)
        report.line(f"blocked time per checkpoint, sync / background: {C.fmt_ratio(blocked)}")
        report.line(f"whole round (save + {args.steps_between} steps + wait), sync / background: {C.fmt_ratio(whole)}")
        report.figures = {"rounds": rounds, "blocked_ratio": blocked, "round_ratio": whole, "checkpoint_mb": size,
                          "n_params": run.n_params, "steps_between": args.steps_between}
        run.prefetcher.close()
    report.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
