"""Multiple-choice tasks in the loop (``eval.tasks``): a loop feature that scores the live model at evaluations.

The tasks are read (or built, ``next_line``) and tokenized once, when the run starts, so a bad task file stops the
run before its first step. At each evaluation that ``eval.every_steps`` selects, every rank scores its share of the
items on the prepared model (DDP or any ZeRO stage: every rank runs the same number of forwards) and one
all-reduce sums the counts, so the figures do not depend on the process count (``lmrecipe/tasks.py``). They are
added to the evaluation's metrics row as ``acc/<task>``, ``acc_norm/<task>`` and ``chance/<task>``.
"""

from __future__ import annotations

import logging
import time

from lmrecipe.config import Config
from lmrecipe.tasks import NEXT_LINE, describe, flat_metrics, prepare_tasks, resolve_tasks, score_tasks
from lmrecipe.train.features import LoopFeature

logger = logging.getLogger(__name__)


class TaskEval(LoopFeature):
    """Scores ``eval.tasks`` with the validation; keeps no state across a resume (the tasks are a pure function of
    the configuration and the data)."""

    def __init__(self, cfg: Config, model, accelerator, tokenizer_dir, attention=None):
        from transformers import AutoTokenizer

        self.section, self.train = cfg.eval, cfg.train
        self.model, self.accelerator, self.attention = model, accelerator, attention
        self.batch_size = cfg.train.micro_batch_size
        data_dir = cfg.data.path if cfg.data.path else cfg.data.sources[0].path
        max_length = accelerator.unwrap_model(model).config.max_position_embeddings
        tasks = resolve_tasks(cfg.eval.tasks, data_dir if NEXT_LINE in cfg.eval.tasks else None,
                              cfg.eval.next_line_items, cfg.eval.seed, max_length)
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        self.prepared = prepare_tasks(tasks, tokenizer, max_length)
        self._step = 0
        logger.info("Tasks scored at evaluations: %s", describe(tasks))

    def after_step(self, state, result) -> None:
        self._step = state.step

    def eval_metrics(self, evaluate) -> dict[str, float]:
        if not self.section.due(self._step, self.train.eval_every_steps, self.train.max_steps):
            return {}
        start = time.perf_counter()
        results = score_tasks(self.model, self.prepared, self.accelerator, self.batch_size, self.attention)
        logger.info("Tasks at step %d scored in %.1f s", self._step, time.perf_counter() - start)
        return flat_metrics(results)
