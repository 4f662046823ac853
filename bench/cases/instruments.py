"""What the always-on instruments cost a step, in this process, with the recipe's default budgets.

The hang watchdog's five hooks, and the straggler clock with the goodput ledger: microseconds per unlogged step on a
stand-in trainer (median of 7 blocks of 100,000; on a CPU the straggler clock reads the host clock, on a GPU CUDA
events). One beat of a hang watcher of a 2-rank world on a local ``TCPStore`` (publish, check for a verdict, read both
records): wall and CPU microseconds, and its share of a core at a beat every 5 s and every 0.25 s.
"""

import statistics
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

PAIRS = None
DATA = None
BLOCKS, CALLS = 7, 100_000


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


def stand_in(cfg) -> SimpleNamespace:
    """A trainer holding what the hooks read: rank 0 of 2 on the CPU, between logged steps, no checkpoint due."""
    import torch

    accelerator = SimpleNamespace(process_index=0, num_processes=2, device=torch.device("cpu"), is_main_process=True)
    return SimpleNamespace(run=SimpleNamespace(cfg=cfg, accelerator=accelerator), out_dir=Path("unused"), running_step=0,
                           state=SimpleNamespace(step=1), max_steps=10**9, step_time_s=0.1, stop=None,
                           checkpointer=SimpleNamespace(due=lambda step: False))


def watchdog_step(cfg):
    from lmrecipe.train.callbacks.watchdog import Watchdog

    watchdog, trainer = Watchdog(cfg.distributed), stand_in(cfg)  # its step hooks need no attach

    def step() -> None:
        trainer.running_step += 1
        watchdog.before_step(trainer)
        watchdog.pre_optim_step(trainer)
        trainer.state.step += 1
        watchdog.after_step(trainer, None)
        watchdog.on_step_end(trainer, None)
        watchdog.on_save(trainer)

    return step


def straggler_step(cfg):
    from lmrecipe.train.callbacks.goodput import GoodputLedger
    from lmrecipe.train.callbacks.stragglers import StragglerClock

    trainer, result, clock, ledger = stand_in(cfg), SimpleNamespace(data_time_s=0.0), StragglerClock(), GoodputLedger()
    clock.attach(trainer)
    ledger.attach(trainer)
    ledger.before_step(trainer)  # the session's first step opens the ledger

    def step() -> None:
        ledger.before_step(trainer)
        trainer.run.compute_clock.start()
        trainer.run.compute_clock.stop()
        trainer.state.step += 1
        clock.after_step(trainer, result)
        ledger.on_step_end(trainer, result)
        ledger.on_save(trainer)

    return step


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

    cfg = load_config(args.recipe, ["logging.log_every_steps=1000000000"])  # every timed step unlogged
    for key, what, build in (("watchdog_hooks_us_per_step", "hang watchdog, 5 hooks", watchdog_step),
                             ("stragglers_goodput_us_per_step", "straggler clock + goodput ledger", straggler_step)):
        report.figures[key] = us_per_call(build(cfg))[0]
        report.line(f"{what}: {report.figures[key]:.2f} us per unlogged step (median of {BLOCKS} x {CALLS:,} steps)")
    wall, cpu = beat_us(cfg.distributed)
    report.line(f"one beat of a hang watcher (publish, verdict check, read 2 records): {wall:.0f} us wall, {cpu:.0f} us "
                "CPU; share of one core: " + ", ".join(f"{cpu / (s * 1e6) * 100:.4f} % at a beat every {s} s"
                                                     for s in (5.0, 0.25)))
    report.figures["beat_us"] = {"wall": wall, "cpu": cpu}
