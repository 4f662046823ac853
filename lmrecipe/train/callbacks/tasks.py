"""Multiple-choice tasks in the loop (``eval.tasks``): a callback that scores the live model at evaluations.

The tasks are read (or built, ``next_line``) and tokenized once, when the run starts, so a bad task file stops the
run before its first step. At each evaluation that ``eval.every_steps`` selects, every rank scores its share of the
items on the prepared model (DDP or any ZeRO stage: every rank runs the same number of forwards) and one
all-reduce sums the counts, so the figures do not depend on the process count (``lmrecipe/evaluation/tasks.py``). They are
added to the evaluation's metrics row as ``acc/<task>``, ``acc_norm/<task>`` and ``chance/<task>``.
"""

from __future__ import annotations

import logging
import time

from lmrecipe.config import EvalConfig
from lmrecipe.evaluation.tasks import NEXT_LINE, describe, flat_metrics, prepare_tasks, resolve_tasks, score_tasks
from lmrecipe.parallel.accelerator import unwrap_model
from lmrecipe.train.callback import Callback

logger = logging.getLogger(__name__)


class TaskEval(Callback):
    """Scores ``eval.tasks`` with the validation; keeps no state across a resume (the tasks are a pure function of
    the configuration and the data)."""

    def __init__(self, section: EvalConfig):
        """``section``: the tasks and their cadence."""
        self.section = section

    def attach(self, trainer) -> None:
        """The run's model and data (its first source's folder for ``next_line``, its tokenizer), its batch size and
        the validation's cadence (``train``); the tasks are read and tokenized here, before the first step."""
        from transformers import AutoTokenizer

        run = trainer.run
        section = self.section
        self.train = train = run.cfg.train
        self.model, self.accelerator, self.attention = run.model, run.accelerator, run.attention
        self.batch_size = train.micro_batch_size
        data_dir = run.data.paths[0]
        max_length = unwrap_model(self.accelerator, self.model).config.max_position_embeddings
        tasks = resolve_tasks(section.tasks, data_dir if NEXT_LINE in section.tasks else None,
                              section.next_line_items, section.seed, max_length)
        tokenizer = AutoTokenizer.from_pretrained(run.data.tokenizer_dir)
        self.prepared = prepare_tasks(tasks, tokenizer, max_length)
        logger.info("Tasks scored at evaluations: %s", describe(tasks))

    def eval_figures(self, trainer, evaluate) -> dict[str, float]:
        step = trainer.state.step
        if not self.section.due(step, self.train.eval_every_steps, self.train.max_steps):
            return {}
        start = time.perf_counter()
        results = score_tasks(self.model, self.prepared, self.accelerator, self.batch_size, self.attention)
        logger.info("Tasks at step %d scored in %.1f s", step, time.perf_counter() - start)
        return flat_metrics(results)
