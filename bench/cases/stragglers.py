"""What the straggler instrument and the goodput ledger add to an unlogged step (main thread), in this process.

A stand-in trainer steps 7 blocks of 100,000 unlogged steps through the hooks of ``StragglerClock`` and
``GoodputLedger``: the median block's microseconds per step, on a CPU (the host clock; a GPU records CUDA events).
"""

from pathlib import Path
from types import SimpleNamespace

import torch

from lmrecipe.train.callbacks.goodput import GoodputLedger
from lmrecipe.train.callbacks.stragglers import StragglerClock

from .watchdog import BLOCKS, CALLS, us_per_call

PAIRS = None
DATA = None


def run(args, report) -> None:
    from lmrecipe.config import load_config

    cfg = load_config(args.recipe, ["logging.log_every_steps=1000000000"])
    accelerator = SimpleNamespace(process_index=0, num_processes=2, device=torch.device("cpu"), is_main_process=True)
    trainer = SimpleNamespace(run=SimpleNamespace(cfg=cfg, accelerator=accelerator), out_dir=Path("unused"),
                              state=SimpleNamespace(step=1), max_steps=10**9, step_time_s=0.1, stop=None,
                              checkpointer=SimpleNamespace(due=lambda step: False))
    result, clock, ledger = SimpleNamespace(data_time_s=0.0), StragglerClock(), GoodputLedger()
    clock.attach(trainer)
    ledger.attach(trainer)

    def step() -> None:
        ledger.before_step(trainer)
        trainer.run.compute_clock.start()
        trainer.run.compute_clock.stop()
        trainer.state.step += 1
        clock.after_step(trainer, result)
        ledger.on_step_end(trainer, result)
        ledger.on_save(trainer)

    ledger.before_step(trainer)  # the session's first step opens the ledger
    us = us_per_call(step)[0]
    report.line(f"straggler clock + goodput ledger: {us:.2f} us per unlogged step (median of {BLOCKS} x {CALLS:,} "
                "steps)")
    report.figures = {"us_per_unlogged_step": us}
