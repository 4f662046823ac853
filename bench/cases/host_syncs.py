"""Host synchronisations per unlogged training step of recipes/tiny.yaml, by kind, counted in this process.

``HostSyncCounter`` around ``train`` of 3 and 11 steps whose only logged steps are the first and the last: the
difference over the extra 8 steps is the count per unlogged step (0 is the target; a GPU waits at each).
"""

import logging
import tempfile

import _common as C

PAIRS = None
SHORT, LONG = 3, 11


def run(args, report) -> None:
    from lmrecipe.observe.host_syncs import HostSyncCounter
    from lmrecipe.train.trainer import train

    logging.disable(logging.INFO)
    counts = {}
    with tempfile.TemporaryDirectory(prefix="bench_syncs_") as tmp:
        for steps in (SHORT, LONG):
            cfg = C.bench_config(args.recipe, [f"train.max_steps={steps}", "schedule.warmup_steps=2",
                                               "logging.log_every_steps=1000"], f"{tmp}/{steps}", args.data)
            with HostSyncCounter() as counter, C.quiet_stdout():
                train(cfg)
            counts[steps] = dict(counter.calls)
    per_step = {k: (counts[LONG].get(k, 0) - counts[SHORT].get(k, 0)) / (LONG - SHORT)
                for k in sorted(counts[SHORT].keys() | counts[LONG].keys())}
    report.line(f"{sum(per_step.values()):.2f} host syncs per unlogged step; by kind: {per_step}")
    report.figures = {"per_unlogged_step": per_step, "counts": counts}
