"""The hang watchdog's own cost: what its hooks add to every step and what one beat of a watcher costs, in this
process, with the recipe's default budgets.

hooks: the five ``Watchdog`` hooks of a step on a stand-in trainer, microseconds per step (median of 7 blocks of
100,000). A beat: a ``HangWatcher`` of a 2-rank world on a local ``TCPStore`` publishes, checks for a verdict and
reads both records: wall and CPU microseconds, and the share of a core at a beat every 5 s and every 0.25 s.
"""

import statistics
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

PAIRS = None
DATA = None
BLOCKS, CALLS = 7, 100_000


def hooks_us_per_step(section) -> float:
    from lmrecipe.train.callbacks.watchdog import Watchdog

    watchdog = Watchdog(section)  # the hooks timed here need no attach (only on_start reads the rank)
    trainer = SimpleNamespace(running_step=0, state=SimpleNamespace(step=0), step_time_s=0.1, stop=None,
                              checkpointer=SimpleNamespace(due=lambda step: False))

    def step() -> None:
        trainer.running_step += 1
        watchdog.before_step(trainer)
        watchdog.pre_optim_step(trainer)
        trainer.state.step += 1
        watchdog.after_step(trainer, None)
        watchdog.on_step_end(trainer, None)
        watchdog.on_save(trainer)

    return us_per_call(step)[0]


def us_per_call(fn, calls: int = CALLS, blocks: int = BLOCKS) -> tuple[float, float]:
    """Wall and thread-CPU microseconds per call of ``fn``: the medians of ``blocks`` blocks of ``calls`` calls."""
    walls, cpus = [], []
    for _ in range(blocks):
        start, cpu = time.perf_counter(), time.thread_time()
        for _ in range(calls):
            fn()
        walls.append((time.perf_counter() - start) / calls * 1e6)
        cpus.append((time.thread_time() - cpu) / calls * 1e6)
    return statistics.median(walls), statistics.median(cpus)


def beat_us(section) -> tuple[float, float]:
    import torch.distributed as dist

    from lmrecipe.train.hang import FORWARD_BACKWARD, Budgets, HangWatcher, Peer, ProgressBoard

    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    for rank in (1, 0):  # both records published; rank 0's watcher, the last, is timed
        client = dist.TCPStore("127.0.0.1", master.port, is_master=False, timeout=timedelta(seconds=5))
        board = ProgressBoard()
        board.enter(5, FORWARD_BACKWARD)
        watcher = HangWatcher(Peer(rank, 2, "host", 1, True), board, Budgets.of(section), Path("unused"), client,
                              prefix="bench/")
        watcher._publish()
    return us_per_call(lambda: (watcher._publish(), watcher._posted_verdict(), watcher._look()), calls=2000)


def run(args, report) -> None:
    from lmrecipe.config import load_config

    section = load_config(args.recipe, []).distributed
    hooks = hooks_us_per_step(section)
    report.line(f"hooks: {hooks:.2f} us per step (5 hooks, median of {BLOCKS} x {CALLS:,} steps)")
    wall, cpu = beat_us(section)
    report.line(f"one beat (publish, verdict check, read 2 records): {wall:.0f} us wall, {cpu:.0f} us CPU")
    report.line("  share of one core: " + ", ".join(f"{cpu / (s * 1e6) * 100:.4f} % at a beat every {s} s" for s in (5.0, 0.25)))
    report.figures = {"hooks_us_per_step": hooks, "beat_us": {"wall": wall, "cpu": cpu}}
