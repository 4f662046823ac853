"""How long the training loop is blocked per checkpoint: synchronous writes against background writes, in one run.

One run of the recipe at --hidden-size x --layers (--deepspeed: that config on one process), two checkpointers of the
trainer's own, ``checkpoint.background_save`` false and true; a round is ``maybe_save``, --steps-between
``train_step`` calls, ``wait`` (docs/benchmarks/09-checkpoint-stall.md).
"""

import logging
import tempfile
from pathlib import Path

import _common as C

PAIRS = 6
SIDES = ("sync", "background")


def options(parser) -> None:
    C.add_wide_model_options(parser)
    parser.add_argument("--deepspeed", default=None, help="a ds_configs JSON (default: no DeepSpeed)")


def name(args) -> str:
    return "checkpoint_stall" + (f"_{Path(args.deepspeed).stem}" if args.deepspeed else "")


def run(args, report) -> None:
    from lmrecipe.train.state import TrainState

    logging.disable(logging.INFO)
    with tempfile.TemporaryDirectory(prefix="bench_ckpt_", dir=args.tmp) as tmp:
        run = C.build_wide_run(args, Path(tmp) / "run", [f"distributed.deepspeed_config={args.deepspeed or 'null'}"])
        checkpointers = {side: C.side_checkpointer(run, Path(tmp) / side, side == "background") for side in SIDES}
        state = TrainState()  # one run's steps, the sides' saves in turn
        report.line(f"model {run.n_params / 1e6:.1f}M params, {run.runtime.topology.zero.describe()}, "
                    f"{run.tokens_per_step} tokens per step, {args.steps_between} steps between saves, "
                    f"threads {args.threads or 'default'}, files in {tmp}")
        for _ in range(2):  # warm-up: the first steps (and one save of each side, interleave's warm-up round)
            C.advance(run, state)
        rounds, stats = C.interleave(
            report, args.pairs, SIDES, lambda side: C.save_round(run, checkpointers[side], state, args.steps_between),
            {"blocked ratio": lambda g: g["sync"]["blocked_s"] / g["background"]["blocked_s"],
             "round ratio": lambda g: ((g["sync"]["blocked_s"] + g["sync"]["steps_s"])
                                       / (g["background"]["blocked_s"] + g["background"]["steps_s"]))},
            lambda g: " | ".join(f"{side} save {1e3 * r['save_s']:,.0f} ms + wait {1e3 * r['wait_s']:,.0f} ms, "
                                 f"step {1e3 * r['step_s']:,.0f} ms" for side, r in g.items()), warm_up=True)
        size = C.folder_mb(checkpointers["sync"].latest)
        report.line(f"checkpoint size {size:,.0f} MB")
        for side in SIDES:
            ms = {key: 1e3 * C.median_of(rounds[side], key) for key in ("blocked_s", "save_s", "wait_s", "step_s")}
            report.line(f"{side:>10}: loop blocked {ms['blocked_s']:,.0f} ms per checkpoint (save {ms['save_s']:,.0f} ms "
                        f"+ wait {ms['wait_s']:,.0f} ms); step after the save {ms['step_s']:,.0f} ms")
        report.line(f"blocked time per checkpoint, sync / background: {C.fmt_ratio(stats['blocked ratio'])}")
        report.line(f"whole round (save + {args.steps_between} steps + wait), sync / background: "
                    f"{C.fmt_ratio(stats['round ratio'])}")
        report.figures = {"rounds": rounds, "blocked_ratio": stats["blocked ratio"], "round_ratio": stats["round ratio"],
                          "checkpoint_mb": size, "n_params": run.n_params, "steps_between": args.steps_between}
        run.prefetcher.close()
