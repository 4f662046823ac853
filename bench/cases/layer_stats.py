"""The per-layer instruments' cost (``logging.layer_stats``): CPU seconds of a logged and of an unlogged step, on
against off: two ``_common.OursLoop`` in alternating blocks of --log-every steps (docs/benchmarks/15-layer-stats.md).
"""

import statistics

import _common as C

PAIRS = 20
DEVICE = True
KINDS = ("logged", "unlogged")


def options(parser) -> None:
    parser.add_argument("--overrides", nargs="*", default=C.TINY_FAST, help="recipe overrides (default: %(default)s)")
    parser.add_argument("--log-every", type=int, default=5,
                        help="logging.log_every_steps, the block length (default: %(default)s)")


def check(args) -> None:
    if args.log_every < 2:
        raise C.fail(f"--log-every {args.log_every}: give 2 or more, so that each block holds unlogged steps.")


def run(args, report) -> None:
    from lmrecipe.observe.console import log_due

    every = [*args.overrides, f"logging.log_every_steps={args.log_every}"]
    with (C.ours_loop(args.recipe, [*every, "logging.layer_stats=false"], args.data) as off,
          C.ours_loop(args.recipe, [*every, "logging.layer_stats=true"], args.data) as on):
        loops, cfg = {"off": off, "on": on}, off.cfg
        report.line(f"model: {off.n_params / 1e6:.2f}M params, {cfg.model.num_layers} layers x {cfg.model.hidden_size} "
                    f"wide, {off.tokens_per_step} tokens/step, precision {off.precision}, device {off.device}; a row "
                    f"every {args.log_every} steps")

        def measure(side: str) -> dict:
            steps = [(C.timed_block(loops[side], 1), loops[side].state.step) for _ in range(args.log_every)]
            kinds = {kind: [(t.cpu_s, t.wall_s) for t, step in steps
                            if log_due(cfg.logging, step, cfg.train.max_steps) == (kind == "logged")] for kind in KINDS}
            means = {kind: [statistics.mean(v[j] for v in values) for j in (0, 1)]  # the warm-up may be all logged
                     for kind, values in kinds.items() if values}
            return {"cpu_ms": {k: [1000 * c for c, _ in v] for k, v in kinds.items()}, "mean": means}

        def ratio(kind: str, j: int):
            return lambda got: got["on"]["mean"][kind][j] / got["off"]["mean"][kind][j]

        # the warm-up round: step 1 (logged, first-call costs) and the rest of its block
        got, stats = C.interleave(report, args.pairs, ("off", "on"), measure,
                                  {f"{kind} {what}": ratio(kind, j) for kind in KINDS for j, what in ((0, "CPU"), (1, "wall"))},
                                  warm_up=True)
        figures = {}
        for kind in KINDS:
            median = {side: statistics.median(ms for r in got[side] for ms in r["cpu_ms"][kind]) for side in loops}
            report.line(f"{kind} step, CPU seconds on / off: {C.fmt_ratio(stats[f'{kind} CPU'])}; wall: "
                        f"{C.fmt_ratio(stats[f'{kind} wall'])}; median CPU ms per step off {median['off']:.1f}, on "
                        f"{median['on']:.1f}")
            figures[kind] = {"cpu_ratio": stats[f"{kind} CPU"], "wall_ratio": stats[f"{kind} wall"], "median_cpu_ms": median}
        report.figures = {**figures, "n_params": off.n_params, "tokens_per_step": off.tokens_per_step,
                          "log_every_steps": args.log_every}
