"""Stragglers (``docs/hangs.md``): each rank's compute time, and the rank that stays slower than the others.

:class:`ComputeClock` times the forward (loss included) of each of a rank's micro-batches: CUDA events on the
compute stream on a GPU, the host's clock on a CPU. The forward is where a data-parallel rank computes alone; the
backward holds the gradient reduction, in which every rank waits for the slowest, so timing it would make every rank
read alike. Recording an event makes no host sync; the clock is read (:meth:`ComputeClock.take_s`, which waits for
the last event) only at logged steps, whose reduction carries every rank's figure as one vector
(:func:`rank_vector`).

:class:`StragglerDetector` reads that vector at each logged step: a rank slower than the median rank by
``distributed.straggler_margin`` at ``distributed.straggler_logged_steps`` logged steps in a row is named, with its
host, in the log and in the step's ``metrics.jsonl`` row.
"""

from __future__ import annotations

import logging
import socket
import statistics
import time
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)


class ComputeClock:
    """Seconds of the timed sections since the last :meth:`take_s`, on ``device``'s compute stream (CUDA) or the host's
    clock (any other device)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.seconds = 0.0
        self._pairs: list[tuple] = []
        self._pool: list[tuple] = []  # recorded pairs already read: events are reused, not created every step
        self._open = None

    def start(self) -> None:
        if not self.cuda:
            self._open = time.perf_counter()
            return
        pair = self._pool.pop() if self._pool else (torch.cuda.Event(enable_timing=True),
                                                    torch.cuda.Event(enable_timing=True))
        pair[0].record()
        self._open = pair

    def stop(self) -> None:
        if not self.cuda:
            self.seconds += time.perf_counter() - self._open
        else:
            self._open[1].record()
            self._pairs.append(self._open)
        self._open = None

    def take_s(self) -> float:
        """The seconds timed since the last call (on a GPU this waits for the last recorded event: a host sync)."""
        if self._pairs:
            self._pairs[-1][1].synchronize()
            self.seconds += sum(start.elapsed_time(end) for start, end in self._pairs) / 1000
            self._pool += self._pairs
            self._pairs = []
        seconds, self.seconds = self.seconds, 0.0
        return seconds


def rank_vector(seconds: float, rank: int, world_size: int) -> torch.Tensor:
    """``seconds`` at ``rank``'s place of a ``[world_size]`` vector of zeros: summed over ranks it holds every rank's."""
    vector = torch.zeros(world_size, dtype=torch.float64)
    vector[rank] = seconds
    return vector


def rank_hosts(world_size: int) -> list[str]:
    """Every rank's host name, by rank (one collective; call it at the start, not in a step)."""
    host = socket.gethostname()
    if world_size < 2 or not torch.distributed.is_initialized():
        return [host] * world_size
    hosts: list = [None] * world_size
    torch.distributed.all_gather_object(hosts, host)
    return hosts


@dataclass(frozen=True)
class Straggler:
    rank: int
    host: str
    ratio: float
    """The rank's compute time over the median rank's, at the latest logged step."""

    def as_row(self) -> dict:
        return {"rank": self.rank, "host": self.host, "ratio": round(self.ratio, 4)}


class StragglerDetector:
    """Names a rank slower than the median by ``margin`` (a fraction) at ``logged_steps`` logged steps in a row."""

    def __init__(self, margin: float, logged_steps: int, hosts: list[str]):
        self.margin = margin
        self.logged_steps = logged_steps
        self.hosts = hosts
        self.streaks = [0] * len(hosts)
        self.warm = False

    def observe(self, step: int, seconds_per_step: list[float]) -> dict:
        """The row's figures for one logged step from every rank's compute seconds per step: the median, the slowest
        rank and its time, and ``stragglers`` (the ranks slow for ``logged_steps`` logged steps in a row, or []).
        The session's first logged step is not compared: its interval holds the warm-up (first calls, allocations)."""
        median = statistics.median(seconds_per_step)
        slowest = max(range(len(seconds_per_step)), key=seconds_per_step.__getitem__)
        named = []
        warm, self.warm = self.warm, True
        for rank, seconds in enumerate(seconds_per_step if warm else ()):
            slow = median > 0 and seconds > median * (1 + self.margin)
            self.streaks[rank] = self.streaks[rank] + 1 if slow else 0
            if self.streaks[rank] >= self.logged_steps:
                named.append(Straggler(rank, self.hosts[rank], seconds / median))
                if self.streaks[rank] == self.logged_steps:
                    logger.warning(
                        "Straggler: rank %d on %s computes %.2fx the median rank's time (%.4f s against %.4f s of "
                        "forward per step) at %d logged steps in a row, up to step %d; every rank waits for it at "
                        "each gradient reduction (docs/hangs.md, Stragglers).", rank, self.hosts[rank],
                        seconds / median, seconds, median, self.logged_steps, step)
        return {"compute_s_median": median, "compute_s_max": seconds_per_step[slowest], "compute_slowest_rank": slowest,
                "stragglers": [s.as_row() for s in named]}

    def reset(self) -> None:
        """Forget the streaks (a rollback: the steps after it are new ones)."""
        self.streaks = [0] * len(self.hosts)
