"""What the run doctor (``observe/doctor.py``) reads and returns: a run's ``metrics.jsonl`` rows (:func:`read_rows`,
also while the run writes the file), the figures its checks read (:class:`RunFigures`) and a symptom found
(:class:`Finding`)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from lmrecipe.errors import fail

METRICS_FILE = "metrics.jsonl"
RUN_META_FILE = "run_meta.json"


def finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


@dataclass(frozen=True)
class Finding:
    """One symptom: ``name`` (a stable identifier), what is seen, the evidence, the likely cause and the fix."""

    name: str
    symptom: str
    evidence: str
    cause: str
    fix: str

    def lines(self) -> list[str]:
        return [f"[{self.name}] {self.symptom}", f"  evidence: {self.evidence}", f"  cause: {self.cause}",
                f"  fix: {self.fix}"]


@dataclass(frozen=True)
class RunFigures:
    """What the checks read: the training and validation rows, the configuration and the sessions."""

    train: list[dict]
    val: list[dict]
    config: dict
    meta: dict

    def key(self, dotted: str, default=None):
        section, _, name = dotted.partition(".")
        return self.config.get(section, {}).get(name, default)

    @property
    def warmup_steps(self) -> int:
        return int(self.key("schedule.warmup_steps", 0) or 0)

    def after_warmup(self) -> list[dict]:
        return [r for r in self.train if r["step"] >= self.warmup_steps]

    def epochs(self, step: int) -> float | None:
        """Passes over the training windows by ``step``, from the tokens seen by then (a batch-size ramp
        included); None when the run does not say how many windows there are."""
        windows, seq_len = self.meta.get("n_train_windows"), self.key("data.seq_len")
        seen = max((r["tokens_seen"] for r in self.train if r["step"] <= step and finite(r.get("tokens_seen"))),
                   default=None)
        if not isinstance(windows, int) or not windows:
            return None
        if seen is not None and seq_len:
            return seen / (windows * seq_len)
        batch = self.key("train.global_batch_size")
        return step * batch / windows if batch else None


def read_rows(path: Path) -> list[dict]:
    """The rows of a ``metrics.jsonl``; a last line that is not (yet) valid JSON is left out: the run is writing it.
    UserError for an earlier line that is not, a line that is not a JSON object, and a training or validation row
    without its integer ``step``."""
    if not path.is_file():
        return []
    damaged = "The file was edited or damaged; restore it, or delete the line to read the rest."
    lines = path.read_bytes().splitlines()
    rows = []
    for number, raw in enumerate(lines, 1):
        try:
            line = raw.decode("utf-8")
            row = json.loads(line) if line.strip() else None
        except ValueError:  # UnicodeDecodeError included
            if number < len(lines):
                raise fail(f"{path}, line {number}, is not a JSON object: {raw[:80]!r}. {damaged}") from None
            continue
        if row is None:
            continue
        if not isinstance(row, dict):
            raise fail(f"{path}, line {number}, is not a JSON object: {line[:80]!r}. {damaged}")
        step = row.get("step")
        if ("loss" in row or "val_loss" in row) and (not isinstance(step, int) or isinstance(step, bool)):
            raise fail(f"{path}, line {number}, is a metrics row without an integer \"step\" ({line[:80]!r}). "
                       f"{damaged}")
        rows.append(row)
    return rows
