"""The ``eval`` section: multiple-choice tasks and samples scored on the live model during training.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from lmrecipe.config.sections.common import due_at, positive
from lmrecipe.errors import fail


@dataclass
class EvalConfig:
    tasks: list[str] = field(default_factory=list)
    """Multiple-choice tasks scored by log-likelihood on the live model at evaluations (``lmrecipe/evaluation/tasks.py``):
    JSON-lines task files, or ``next_line`` (the true next line of a held-out document against lines of other
    documents, built from the validation split of ``data.path``, or of the first of ``data.sources``). Logged as
    ``acc/<task>``, ``acc_norm/<task>`` and ``chance/<task>``. [] = none."""
    every_steps: Optional[int] = None
    """Score the tasks every this many optimizer steps (and at the end): a multiple of ``train.eval_every_steps``,
    since they run with the validation; null = at every validation."""
    next_line_items: int = 100
    """Items of the ``next_line`` task (4 choices each: chance is 25 %)."""
    seed: int = 0
    """Seed of the ``next_line`` task's items and distractors."""
    samples: list[str] = field(default_factory=list)
    """Prompts continued at every evaluation by greedy decoding of the live model, e.g. ``["def main(", "import "]``:
    the texts go to ``metrics.jsonl`` (a ``samples`` row) and the last evaluation's to ``report.md``. [] = none."""
    sample_tokens: int = 16
    """Tokens generated for each of ``samples`` (fewer when the continuation reaches the end-of-text token)."""

    def validate(self) -> None:
        positive(self, "next_line_items", "sample_tokens")
        for i, prompt in enumerate(self.samples):
            if not isinstance(prompt, str) or not prompt.strip():
                raise fail(f"eval.samples[{i}]={prompt!r} is not a prompt: give each sample a non-empty string, e.g. "
                           "eval.samples='[\"def main(\"]'.")
        if self.every_steps is not None:
            positive(self, "every_steps")
        names = [Path(spec).stem for spec in self.tasks]
        if len(set(names)) != len(names):
            raise fail(f"eval.tasks={self.tasks} names two tasks of one name (a task is named after its file's stem): "
                       "rename one of the files.")

    def due(self, step: int, eval_every_steps: int, max_steps: int) -> bool:
        """Whether the tasks are scored at the evaluation after ``step``."""
        return bool(self.tasks) and due_at(step, self.every_steps or eval_every_steps, max_steps)
