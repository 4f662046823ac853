"""Preemption: SIGTERM / SIGUSR1 or the death of the launcher asks the loop to save and exit with code 124.
"""

from __future__ import annotations

import logging
import os
import signal

import torch

logger = logging.getLogger(__name__)

class PreemptionSignal:
    """Records SIGTERM / SIGUSR1, or the death of the launcher, so the loop can finish its step, save and exit.

    A launcher that dies (``accelerate launch`` exits at once on SIGUSR1) leaves its ranks running as orphans:
    they notice their parent changed and stop the same way, with a checkpoint.
    """

    def __init__(self):
        self.name: str | None = None
        self._parent = os.getppid()
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.name = signal.Signals(signum).name

    def requested(self, accelerator, exchange: bool) -> bool:
        """True on every rank when any rank got the signal or lost its launcher.

        One process decides alone at every step. Several exchange their flags (a tiny all-reduce read on the
        host, so a sync) only when ``exchange`` is set, at the loop's sync points: a signal waits at most until
        the next one (``logging.log_every_steps`` steps), and every rank stops at the same step.
        """
        if self.name is None and os.getppid() != self._parent:
            self.name = "the exit of the launcher (parent process)"
        if accelerator.num_processes == 1:
            return self.name is not None
        if not exchange:
            return False
        flag = torch.tensor([1.0 if self.name else 0.0], device=accelerator.device)
        return bool(accelerator.reduce(flag, reduction="sum").item() > 0)
