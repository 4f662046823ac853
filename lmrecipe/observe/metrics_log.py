"""The metrics log: ``metrics.jsonl`` (one JSON object per logged step) and its mirror in wandb or tensorboard.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from pathlib import Path

from lmrecipe.fileio import write_text_atomic

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
WANDB_ID_FILE = "wandb_run_id"


class Tracker:
    """Appends one JSON object per row to ``metrics.jsonl`` and mirrors numeric values to a tracker backend.

    Only the main process writes; other ranks get a Tracker with ``enabled=False`` that does nothing.
    A run that starts at ``start_step`` (a resume, or 0) first drops the rows of later steps, written by a
    continuation that was abandoned, so the file, the plots and the trackers show one history. A wandb run keeps
    its id in ``out_dir/wandb_run_id``, so a resumed or requeued job continues the same wandb run.
    """

    def __init__(self, out_dir: Path, backend: str, project: str, run_name: str, config: dict, enabled: bool,
                 start_step: int = 0):
        self.enabled = enabled
        self.out_dir = out_dir
        self.backend = backend
        self._wandb_run = None
        self._tb = None
        self._file = None
        if not enabled:
            return
        dropped = truncate_metrics(out_dir / METRICS_FILE, start_step)
        if dropped:
            logger.info("Dropped %d rows after step %d from %s (an abandoned continuation)", dropped, start_step,
                        out_dir / METRICS_FILE)
        self._file = open(out_dir / METRICS_FILE, "a", buffering=1)  # line-buffered: a crash loses no row
        if backend == "wandb":
            import wandb

            mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
            id_file = out_dir / WANDB_ID_FILE
            run_id = id_file.read_text().strip() if id_file.is_file() else None
            if run_id is None:
                run_id = uuid.uuid4().hex[:8]  # wandb's id form: 8 lowercase alphanumerics
                write_text_atomic(id_file, run_id + "\n")
            self._wandb_run = wandb.init(project=project, name=run_name, dir=str(out_dir), config=config, mode=mode,
                                         id=run_id, resume="allow")
            logger.info("wandb run %s in %s mode under %s", run_id, mode, out_dir / "wandb")
        elif backend == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(out_dir / "tensorboard"))

    def rewind(self, step: int) -> None:
        """Drop the rows after ``step`` (a rollback to that step's checkpoint): metrics.jsonl keeps one history.

        wandb and tensorboard keep what they were sent (neither takes rows back); the continuation logs the steps
        after ``step`` again, as after a resume.
        """
        if not self.enabled:
            return
        self._file.close()
        dropped = truncate_metrics(self.out_dir / METRICS_FILE, step)
        logger.info("Dropped %d rows after step %d from %s (rolled back)", dropped, step, self.out_dir / METRICS_FILE)
        self._file = open(self.out_dir / METRICS_FILE, "a", buffering=1)

    def log(self, row: dict) -> None:
        if not self.enabled:
            return
        self._file.write(json.dumps(row) + "\n")
        step = row["step"]
        numbers = {k: v for k, v in row.items() if isinstance(v, (int, float)) and k != "step"}
        if self._wandb_run is not None:
            self._wandb_run.log(numbers, step=step)
        if self._tb is not None:
            for key, value in numbers.items():
                self._tb.add_scalar(key, value, step)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._wandb_run is not None:
            self._wandb_run.finish()
        if self._tb is not None:
            self._tb.close()


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
