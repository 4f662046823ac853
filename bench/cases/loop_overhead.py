"""Loop overhead: train.py's step (Trainer.step over train_step) against a minimal raw PyTorch loop, tokens/s.

``_common.OursLoop`` (every callback a run has) against ``_common.RawLoop`` in alternating blocks of --block-steps
steps, in this process. Target: median ours / raw >= 0.97 (docs/benchmarks/01-loop-overhead.md).
"""

import _common as C

PAIRS = 20
DEVICE = True
SECTIONS = ["forward+loss", "backward", "clip+optimizer", "data", "rest (bookkeeping)", "step"]


def options(parser) -> None:
    parser.add_argument("--overrides", nargs="*", default=C.TINY_FAST, help="recipe overrides (default: %(default)s)")
    parser.add_argument("--block-steps", type=int, default=10, help="optimizer steps per timed block (default: %(default)s)")
    parser.add_argument("--warmup-steps", type=int, default=5, help="untimed steps of each side first (default: %(default)s)")


def run(args, report) -> None:
    with C.ours_loop(args.recipe, args.overrides, args.data) as ours:
        cfg, loops = ours.cfg, {"ours": ours, "raw": C.RawLoop(ours)}
        report.line(f"model: {ours.n_params / 1e6:.2f}M params, {cfg.model.num_layers} layers x {cfg.model.hidden_size} "
                    f"wide, seq_len {cfg.data.seq_len}, micro-batch {cfg.train.micro_batch_size} x accumulation "
                    f"{ours.layout.accum_steps} = {ours.tokens_per_step} tokens/step, precision {ours.precision}, "
                    f"grad_clip {cfg.optim.grad_clip}, device {ours.device}")
        for loop in loops.values():
            C.timed_block(loop, args.warmup_steps)
            loop.sections.clear()
        timings, stats = C.interleave(
            report, args.pairs, ("ours", "raw"), lambda side: C.timed_block(loops[side], args.block_steps),
            {"ours/raw tokens/s": lambda got: got["raw"].wall_s / got["ours"].wall_s,
             "CPU-time ratio": lambda got: got["raw"].cpu_s / got["ours"].cpu_s},
            lambda got: "  ".join(f"{side} {args.block_steps * ours.tokens_per_step / t.wall_s:,.0f} tok/s"
                                  for side, t in got.items()))
    ratio, cpu = stats["ours/raw tokens/s"], stats["CPU-time ratio"]
    report.line(f"ours / raw tokens/s: {C.fmt_ratio(ratio)}   target >= 0.97: "
                f"{'MET' if ratio['median'] >= 0.97 else 'MISSED'}")
    report.line(f"same, from CPU seconds per step (raw / ours; less sensitive to other processes): {C.fmt_ratio(cpu)}")
    # ms per step of each section; ours' extra time is its data fetch and bookkeeping over raw's (the sections both
    # loops share run the same kernels: a steadier figure than the ratio of two noisy step times)
    n_steps, breakdown = args.pairs * args.block_steps, {}
    report.line(f"per step (ms, mean over the {n_steps} timed steps of each side):\n"
                f"  {'section':<20}{'ours':>10}{'raw':>10}")
    for side, loop in loops.items():
        seconds = sum(t.wall_s for t in timings[side])
        parts = {"data": 0.0, **loop.sections}  # raw: data inside its fetch, not timed apart
        parts["rest (bookkeeping)"] = seconds - sum(parts.values())
        breakdown[side] = {k: 1000 * v / n_steps for k, v in parts.items()} | {"step": 1000 * seconds / n_steps}
    ours_ms, raw_ms = breakdown["ours"], breakdown["raw"]
    for key in SECTIONS:
        report.line(f"  {key:<20}{ours_ms.get(key, 0):>10.2f}{raw_ms.get(key, 0):>10.2f}")
    extra_ms = ours_ms["data"] + ours_ms["rest (bookkeeping)"] - raw_ms["rest (bookkeeping)"]
    share = extra_ms / ours_ms["step"]
    report.line(f"ours' extra time (data fetch + bookkeeping - raw's bookkeeping): {extra_ms:.2f} ms/step = "
                f"{100 * share:.2f}% of its step, i.e. {1 - share:.3f}x raw's tokens/s if the shared sections ran "
                "equally fast")
    report.figures = {"ratio_ours_over_raw": ratio, "extra_ms_per_step": extra_ms, "implied_ratio": 1 - share,
                      "cpu_time_ratio": cpu, "ms_per_step": breakdown, "tokens_per_step": ours.tokens_per_step,
                      "tokens_per_sec": {side: [args.block_steps * ours.tokens_per_step / t.wall_s for t in ts]
                                         for side, ts in timings.items()}, "n_params": ours.n_params}
