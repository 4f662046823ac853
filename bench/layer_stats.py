"""The per-layer instruments' cost (``logging.layer_stats``): CPU seconds of a logged and of an unlogged step, on
against off.

    .venv/bin/python bench/layer_stats.py                          # tiny recipe shape, a row every 5 steps
    .venv/bin/python bench/layer_stats.py --pairs 30 --overrides model.num_layers=8 train.micro_batch_size=4

Two trainers of the same recipe (lmrecipe.train.trainer, stepped by Trainer.step as train.py's loop does), one with
``logging.layer_stats=false``, one with ``true``, run in this process in alternating blocks (off on, on off, ...) of
``logging.log_every_steps`` steps each, so every block holds exactly one logged step. Each step's CPU seconds (this
process, all threads) and wall seconds are taken apart; per round the ratio on / off of the logged step and of the
mean unlogged step. The figures are the median of those ratios over the rounds, with min and max. On a loaded machine
these whole-step ratios scatter widely, so the CPU seconds spent inside the instrument itself (its ``before_step``,
its gradient probe and its ``after_step``; the forward hooks' few reductions are not in it) are reported too, per
logged and per unlogged step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import _common as C  # noqa: E402

TINY_FAST = ["train.global_batch_size=8", "train.micro_batch_size=4"]


def timed_steps(loop, n_steps: int, device) -> list[tuple[int, float, float]]:
    """(step, CPU seconds, wall seconds) of each of the next ``n_steps`` steps of ``loop``."""
    out = []
    with C.quiet_stdout():
        for _ in range(n_steps):
            C.sync(device)
            start, cpu_start = time.perf_counter(), time.process_time()
            loop.trainer.step()
            C.sync(device)
            out.append((loop.state.step, time.process_time() - cpu_start, time.perf_counter() - start))
    return out


def cpu_counted(instrument, method, totals: dict[str, float]):
    """``method`` of ``instrument`` adding its CPU seconds to ``totals["logged"]`` when the instrument is armed (a
    logged step) before or after the call, else to ``totals["unlogged"]``."""
    def counted(*args, **kwargs):
        armed, start = instrument.armed is not None, time.process_time()
        try:
            return method(*args, **kwargs)
        finally:
            key = "logged" if armed or instrument.armed is not None else "unlogged"
            totals[key] = totals.get(key, 0.0) + time.process_time() - start
    return counted


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="recipes/tiny.yaml")
    parser.add_argument("--overrides", nargs="*", default=TINY_FAST, help="key=value recipe overrides (default: %(default)s)")
    parser.add_argument("--data", default="data/stdlib", help="prepared data folder (default: %(default)s)")
    parser.add_argument("--log-every", type=int, default=5,
                        help="logging.log_every_steps, the block length (default: %(default)s)")
    C.add_common_args(parser, pairs=20)
    args = parser.parse_args()
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    C.set_threads(args.threads)
    C.check_data(args.data)
    from lmrecipe.observe.console import log_due

    report = C.Report("layer_stats", args.device, args.output)
    with tempfile.TemporaryDirectory(prefix="bench_layer_stats_") as tmp:
        loops = {}
        for side in ("off", "on"):
            cfg = C.bench_config(args.recipe, [*args.overrides, f"logging.log_every_steps={args.log_every}",
                                               f"logging.layer_stats={'true' if side == 'on' else 'false'}"],
                                 out_dir=f"{tmp}/{side}", data_path=args.data)
            loops[side] = C.OursLoop(cfg, Path(tmp) / side)
        off = loops["off"]
        device = off.accelerator.device
        report.line(f"model: {off.n_params / 1e6:.2f}M params, {cfg.model.num_layers} layers x {cfg.model.hidden_size} "
                    f"wide, {off.tokens_per_step} tokens/step, precision {off.precision}, device {device}; a row every "
                    f"{args.log_every} steps")
        own_cpu_s: dict[str, float] = {}
        instrument = next(c for c in loops["on"].trainer.callbacks if type(c).__name__ == "LayerStats")
        for name in ("before_step", "_read_gradients", "after_step"):
            setattr(instrument, name, cpu_counted(instrument, getattr(instrument, name), own_cpu_s))
        for loop in loops.values():  # step 1 (logged, first-call costs) and the rest of its block, untimed
            timed_steps(loop, args.log_every, device)

        def logged(step: int) -> bool:
            return log_due(cfg.logging, step, cfg.train.max_steps)

        ratios = {"logged": [], "unlogged": []}
        wall_ratios = {"logged": [], "unlogged": []}
        cpu_ms = {side: {"logged": [], "unlogged": []} for side in loops}
        own_ms = {"logged": [], "unlogged": []}
        for i, order in enumerate(C.pair_orders(args.pairs, ("off", "on"))):
            got = {}
            for side in order:
                if side == "on":
                    own_cpu_s.clear()
                steps = timed_steps(loops[side], args.log_every, device)
                if side == "on":
                    own_ms["logged"].append(1000 * own_cpu_s.get("logged", 0.0))
                    own_ms["unlogged"].append(1000 * own_cpu_s.get("unlogged", 0.0) / (args.log_every - 1))
                got[side] = {kind: [(cpu, wall) for step, cpu, wall in steps if logged(step) == (kind == "logged")]
                             for kind in ("logged", "unlogged")}
                for kind, values in got[side].items():
                    cpu_ms[side][kind] += [1000 * cpu for cpu, _ in values]
            for kind in ratios:
                mean = {side: [statistics.mean(v[j] for v in got[side][kind]) for j in (0, 1)] for side in loops}
                ratios[kind].append(mean["on"][0] / mean["off"][0])
                wall_ratios[kind].append(mean["on"][1] / mean["off"][1])
            report.line(f"round {i + 1:>2} ({' '.join(order)}): CPU on/off logged step {ratios['logged'][-1]:.3f}, "
                        f"unlogged step {ratios['unlogged'][-1]:.3f}")
        report.line()
        figures = {}
        for kind in ratios:
            stats, wall = C.ratio_stats(ratios[kind]), C.ratio_stats(wall_ratios[kind])
            median = {side: statistics.median(cpu_ms[side][kind]) for side in loops}
            report.line(f"{kind} step, CPU seconds on / off: {C.fmt_ratio(stats)}; wall: {C.fmt_ratio(wall)}; median CPU "
                        f"ms per step off {median['off']:.1f}, on {median['on']:.1f}")
            own = C.ratio_stats(own_ms[kind])
            report.line(f"  inside the instrument: {C.fmt_ratio(own, ' CPU ms')} per {kind} step, i.e. "
                        f"{100 * own['median'] / median['off']:.2f}% of the median {kind} step off")
            figures[kind] = {"cpu_ratio": stats, "wall_ratio": wall, "median_cpu_ms": median, "instrument_cpu_ms": own}
        report.figures = {**figures, "n_params": off.n_params, "tokens_per_step": off.tokens_per_step,
                          "log_every_steps": args.log_every}
        for loop in loops.values():
            loop.close()
    report.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
