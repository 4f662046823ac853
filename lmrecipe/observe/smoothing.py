"""The logged loss smoothed for judging a run (``observe/doctor.py``): consecutive windows' means, and the loss's
step-to-step scatter, which a difference of means must exceed to count."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

SMOOTH_ROWS = 5
"""Consecutive logged losses whose mean is one point of the smoothed curve the loss checks judge (a tenth of the
rows when that is more, a third when there are fewer than fifteen). One logged loss is one step's, and it varies
with the step's batch: a standard deviation of 0.25 nats around its trend in the demo (``recipes/tiny.yaml``, 16 x
128 tokens a step), so the lowest of 30 single steps sits far below the curve and a few later ones above it."""


def _median(values) -> float:
    return statistics.median(values)


def window(count: int) -> int:
    """Rows per point of the smoothed loss for ``count`` rows: :data:`SMOOTH_ROWS` or a tenth, at most a third."""
    return max(1, min(max(SMOOTH_ROWS, count // 10), count // 3))


@dataclass(frozen=True)
class Smoothed:
    """The mean loss of consecutive logged rows: one point of the smoothed curve."""

    rows: list[dict]

    @property
    def loss(self) -> float:
        return statistics.fmean(r["loss"] for r in self.rows)

    @property
    def lr(self) -> float:
        return _median(r.get("lr", float("nan")) for r in self.rows)

    def span(self) -> str:
        first, last = self.rows[0]["step"], self.rows[-1]["step"]
        return f"step {first}" if first == last else f"steps {first}-{last}"


def smoothed(rows: list[dict], from_end: bool) -> list[Smoothed]:
    """The rows' losses as consecutive means of :func:`window` rows, whole windows only, counted from the last row
    (``from_end``, so that the last point is the end of the run) or from the first."""
    size = window(len(rows))
    starts = range(len(rows) % size, len(rows), size) if from_end else range(0, len(rows) - size + 1, size)
    return [Smoothed(rows[i:i + size]) for i in starts]


def loss_scatter(rows: list[dict]) -> float:
    """The step-to-step scatter of the logged losses (a standard deviation, nats): the median absolute second
    difference scaled to a normal's, so that a smooth trend and a few spikes leave it alone."""
    losses = [r["loss"] for r in rows]
    second = [abs(a - 2 * b + c) for a, b, c in zip(losses, losses[1:], losses[2:])]
    return 1.4826 * _median(second) / math.sqrt(6) if second else 0.0
