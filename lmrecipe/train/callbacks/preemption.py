"""Stopping cleanly: SIGTERM / SIGUSR1, Ctrl-C, the death of the launcher, and the death of a peer rank.

SIGTERM, SIGUSR1 and a dead launcher ask the loop to save and exit with code 124 (a requeue resumes); Ctrl-C
(SIGINT) asks the same and exits 130; a second Ctrl-C stops at once, without saving. A peer rank that dies
(``kill -9``, a crash) breaks the next collective: :func:`lost_peer_error` turns that into one line naming it.
The :class:`Preemption` callback does both for the trainer.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path

import torch

from lmrecipe.checkpoint.storage import EXIT_PREEMPTED
from lmrecipe.errors import EXIT_INTERRUPTED, EXIT_LOST_PEER, UserError, fail
from lmrecipe.train.callback import Callback, Stop

logger = logging.getLogger(__name__)

LAUNCHER_ENV = ("TORCHELASTIC_RUN_ID", "LOCAL_RANK", "ACCELERATE_DYNAMO_BACKEND")
"""Variables that torchrun / ``accelerate launch`` set in the processes they start: only those have a launcher
whose death means "stop". A plain ``python train.py`` whose shell exits (``nohup ... &``) goes on."""
_REPEAT_S = 1.0
"""A second SIGINT this soon after the first is the same Ctrl-C, delivered again (torchrun forwards the terminal's
SIGINT to its workers, which also got it from the terminal)."""
_EXIT_WAIT_S = 3.0
"""How long a survivor looks for a local peer's exit to show once a collective broke (see :func:`lost_peer_error`)."""
LAUNCHER_EXIT = "the exit of the launcher (parent process)"
STOPS = ("SIGINT", "SIGTERM", "SIGUSR1", LAUNCHER_EXIT)
"""What can stop a run, in the order that names a stop several ranks got differently (Ctrl-C's exit code first)."""
_PEER_LOSS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "NCCL", "ProcessGroup")


def started_by_launcher(environ=os.environ) -> bool:
    """Whether this process was started by a launcher (torchrun, ``accelerate launch``), per :data:`LAUNCHER_ENV`."""
    return any(name in environ for name in LAUNCHER_ENV)


class PreemptionSignal:
    """Records SIGTERM / SIGUSR1 / SIGINT, or the death of the launcher, so the loop can finish its step, save and exit.

    A launcher that dies (``accelerate launch`` exits at once on SIGUSR1) leaves its ranks running as orphans:
    they notice their parent changed and stop the same way, with a checkpoint. Only processes started by a
    launcher watch their parent (``launched``; default: :func:`started_by_launcher`).
    :meth:`close` restores the handlers that were there before.
    """

    def __init__(self, launched: bool | None = None):
        self.name: str | None = None
        self._parent = os.getppid()
        self._launched = started_by_launcher() if launched is None else launched
        self._first_sigint: float | None = None
        # SIGINT stays ignored where the parent ignores it (a background job of a script, as in slurm/launch.sh).
        caught = [signal.SIGTERM, signal.SIGUSR1] + ([signal.SIGINT] if signal.getsignal(signal.SIGINT) != signal.SIG_IGN else [])
        self._previous = {sig: signal.signal(sig, self._handle) for sig in caught}

    @property
    def exit_code(self) -> int:
        """What the process exits with once stopped: 130 after Ctrl-C, 124 otherwise."""
        return EXIT_INTERRUPTED if self.name == "SIGINT" else EXIT_PREEMPTED

    def _handle(self, signum, frame) -> None:
        if signum == signal.SIGINT:
            now = time.monotonic()
            if self._first_sigint is not None and now - self._first_sigint > _REPEAT_S:
                # Straight to the file descriptor: the process ends here, with no flushing of Python's buffers.
                os.write(sys.stderr.fileno(), b"Second Ctrl-C: stopping now, without a checkpoint. Resume from the "
                         b"last one with checkpoint.resume=auto.\n")
                os._exit(EXIT_INTERRUPTED)
            if self._first_sigint is None:
                self._first_sigint = now
                logger.info("Ctrl-C: finishing this step, saving a checkpoint and stopping (exit 130). Press Ctrl-C "
                            "again to stop at once without saving.")
        if self.name is None:
            self.name = signal.Signals(signum).name

    def close(self) -> None:
        """Put back the signal handlers found at construction."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)

    def requested(self, accelerator, exchange: bool) -> bool:
        """True on every rank when any rank got the signal or lost its launcher.

        One process decides alone at every step. Several exchange their flags (a tiny all-reduce read on the
        host, so a sync) only when ``exchange`` is set, at the loop's sync points: a signal waits at most until
        the next one (``logging.log_every_steps`` steps), and every rank stops at the same step.
        """
        if self.name is None and self._launched and os.getppid() != self._parent:
            self.name = LAUNCHER_EXIT
        if accelerator.num_processes == 1:
            return self.name is not None
        if not exchange:
            return False
        # Which stop each rank got. The decision and the name come from the exchanged counts alone, the same on
        # every rank: a signal landing on this rank during the all-reduce waits for the next sync point (reading
        # self.name again here would stop this rank alone, its peers training on into a collective it never joins).
        got = torch.tensor([float(self.name == stop) for stop in STOPS], device=accelerator.device)
        counts = accelerator.reduce(got, reduction="sum").tolist()
        agreed = next((stop for stop, count in zip(STOPS, counts) if count > 0), None)
        if agreed is not None:
            self.name = agreed
        return agreed is not None


class Preemption(Callback):
    """At each step's save point, before the checkpoint's: a signal (on any rank) asks for a checkpoint and an exit
    with the signal's code. When a collective breaks because a peer process died, names it (exit 1)."""

    follows = ("OOMDiagnosis",)  # an out-of-memory error's diagnosis replaces it before a lost peer is looked for

    def __init__(self, signal: PreemptionSignal):
        self.signal = signal

    def attach(self, trainer) -> None:
        self.accelerator = trainer.run.accelerator
        self.checkpoints = trainer.out_dir / "checkpoints"
        self.peers = peer_processes(self.accelerator)  # every rank takes part, before any can be lost

    def on_save(self, trainer) -> None:
        if not self.signal.requested(self.accelerator, exchange=trainer.sync_point):
            return
        trainer.state.sync()  # the checkpoint records the skip counters
        trainer.request_stop(Stop(
            f"Stopped by {self.signal.name} after step {trainer.state.step}; checkpoint "
            "saved. Resume with checkpoint.resume=auto.", exit_code=self.signal.exit_code, save=True))

    def on_error(self, trainer, err: BaseException) -> BaseException | None:
        return lost_peer_error(err, self.peers, self.checkpoints)


def peer_processes(accelerator) -> list[tuple[str, int]]:
    """(host, pid) of every rank, gathered once at start so a lost one can be named later; [] for one process."""
    if accelerator.num_processes == 1:
        return []
    from accelerate.utils import gather_object

    return [tuple(p) for p in gather_object([(socket.gethostname(), os.getpid())])]


def lost_peer_error(err: BaseException, peers: list[tuple[str, int]], checkpoints: Path) -> UserError | None:
    """A UserError (exit :data:`EXIT_LOST_PEER`) naming the rank(s) that died if ``err`` is a collective broken by a lost
    peer, else None."""
    if not peers or not isinstance(err, RuntimeError):
        return None
    text = str(err)
    if not (isinstance(err, getattr(torch.distributed, "DistError", ())) or any(s in text for s in _PEER_LOSS)):
        return None
    host = socket.gethostname()
    dead = _dead_local_peers(peers, host)
    if dead:
        who = ", ".join(f"rank {r} (pid {peers[r][1]})" for r in dead)
        what = f"{who} on {host} died"
    else:
        what = "another rank died or became unreachable (none on this host is gone; look on the other nodes)"
    latest = checkpoints / "latest"
    kept = (f"The last checkpoint is {checkpoints / latest.read_text().strip()}." if latest.is_file()
            else "No checkpoint was saved yet.")
    first_line = text.strip().splitlines()[0].split(". ")[0][:200] if text.strip() else type(err).__name__
    return fail(f"Training stopped: {what}, which broke a collective operation ({first_line}). Its own log says "
                f"why (a kill -9, out of host memory, a crash). {kept} Resume with checkpoint.resume=auto.",
                exit_code=EXIT_LOST_PEER)


def _dead_local_peers(peers: list[tuple[str, int]], host: str, wait_s: float = _EXIT_WAIT_S) -> list[int]:
    """Ranks on this host whose process is gone. A killed process closes its sockets (which breaks the collective)
    before the kernel marks it exited, so the survivor may look in between: it looks again for up to ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while True:
        dead = [rank for rank, (h, pid) in enumerate(peers) if h == host and not process_alive(pid)]
        if dead or time.monotonic() >= deadline:
            return dead
        time.sleep(0.05)


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` on this host is running: a zombie (exited, not yet reaped) counts as gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (killed, not yet reaped by the launcher) still answers kill(0).
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] not in ("Z", "X")
    except OSError:  # its /proc entry went away after kill(0) answered: it has just exited
        return False
