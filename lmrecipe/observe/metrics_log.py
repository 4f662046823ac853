"""The metrics log: ``metrics.jsonl`` (one JSON object per logged step), mirrored to the experiment trackers, and the
run's throughput from its rows (:func:`throughput`), which the report, the plot and the planner all use.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from lmrecipe.fileio import write_text_atomic

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"


class MetricsLog:
    """Appends one JSON object per row to ``metrics.jsonl`` and sends the same rows to the run's trackers
    (``logging.trackers``, ``lmrecipe/observe/trackers.py``).

    Only the main process writes; other ranks get a MetricsLog with ``enabled=False`` that does nothing. A run that
    starts at ``start_step`` (a resume, or 0) first drops the rows of later steps, written by a continuation that
    was abandoned, so the file, the plots and the trackers show one history.
    """

    def __init__(self, out_dir: Path, trackers: list[str], project: str, run_name: str, config: dict, enabled: bool,
                 start_step: int = 0):
        self.enabled = enabled
        self.out_dir = out_dir
        self._file = None
        self.trackers = None
        if not enabled:
            return
        last_logged = last_step(out_dir / METRICS_FILE)
        dropped = truncate_metrics(out_dir / METRICS_FILE, start_step)
        if dropped:
            logger.info("Dropped %d rows after step %d from %s (an abandoned continuation)", dropped, start_step,
                        out_dir / METRICS_FILE)
        self._file = open(out_dir / METRICS_FILE, "a", buffering=1)  # line-buffered: a crash loses no row
        if trackers:
            from lmrecipe.observe.trackers import Trackers

            self.trackers = Trackers(trackers, out_dir, project, run_name, config, start_step, last_logged)

    def rewind(self, step: int) -> None:
        """Drop the rows after ``step`` (a rollback to that step's checkpoint): metrics.jsonl keeps one history, and
        the trackers undo or restart as each can (``lmrecipe/observe/trackers.py``)."""
        if not self.enabled:
            return
        self._file.close()
        dropped = truncate_metrics(self.out_dir / METRICS_FILE, step)
        logger.info("Dropped %d rows after step %d from %s (rolled back)", dropped, step, self.out_dir / METRICS_FILE)
        self._file = open(self.out_dir / METRICS_FILE, "a", buffering=1)
        if self.trackers is not None:
            self.trackers.rewind(step)

    def log(self, row: dict) -> None:
        if not self.enabled:
            return
        self._file.write(json.dumps(row) + "\n")
        if self.trackers is not None:
            self.trackers.log(row)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self.trackers is not None:
            self.trackers.close()


def last_step(path: Path) -> int:
    """The step of the last row of a metrics file (0 when there is none)."""
    rows = read_metrics(path)
    return max((row.get("step", 0) for row in rows), default=0)


def truncate_metrics(path: Path, last_step: int) -> int:
    """Keep the rows of steps <= ``last_step`` (atomically); return how many were dropped."""
    if not path.is_file():
        return 0
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    kept = [line for line in lines if json.loads(line).get("step", 0) <= last_step]
    if len(kept) != len(lines):
        write_text_atomic(path, "".join(line + "\n" for line in kept))
    return len(lines) - len(kept)


def read_metrics(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def intervals(train: list[dict]) -> list[tuple[int, float, float, float]]:
    """(steps, seconds in training steps, tokens, MFU x seconds) of each logged interval.

    A row written before rows carried ``interval_steps`` and ``interval_time_s`` counts the steps since the
    previous row at its mean ``step_time_s``.
    """
    out, previous = [], 0
    for r in train:
        steps = r.get("interval_steps") or r["step"] - previous
        seconds = r.get("interval_time_s")
        seconds = steps * r.get("step_time_s", 0.0) if seconds is None else seconds
        out.append((steps, seconds, r.get("tokens_per_sec", 0.0) * seconds, (r.get("mfu") or 0.0) * seconds))
        previous = r["step"]
    return out


def throughput(train: list[dict]) -> dict:
    """The run's throughput from its training rows: the tokens of the logged intervals over their time in training
    steps (a row's, as ``lmrecipe/observe/console.py`` defines it), not a mean of the intervals' rates, which weighs
    a short fast interval like a long slow one; MFU and step time over the same seconds, so throughput x step time
    = tokens per step."""
    parts = [p for p in intervals(train) if p[1] > 0]
    steps, seconds = sum(p[0] for p in parts), sum(p[1] for p in parts)
    if not seconds:
        return {"tokens_per_sec": None, "mfu": None, "step_time_s": None, "train_time_s": None, "train_tokens": None}
    tokens = sum(p[2] for p in parts)
    return {"tokens_per_sec": tokens / seconds, "mfu": sum(p[3] for p in parts) / seconds,
            "step_time_s": seconds / steps, "train_time_s": seconds, "train_tokens": tokens}
