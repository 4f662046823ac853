"""Evaluation: the validation loss every ``train.eval_every_steps`` steps and at the last, which the trainer measures
after the step's log line (``lmrecipe/train/trainer.py``, :meth:`Trainer.evaluate`).

:class:`Validation` measures the validation loss of the weights the model holds (per source of a mixture), and with
``eval.samples`` continues those prompts by greedy decoding (``eval.sample_tokens`` tokens) on the live model,
decoded with the data's tokenizer. Every rank runs the same forwards (ZeRO-3 gathers the weights on all of them); the
texts travel in the result's figures under ``"samples"`` (a list of ``{"prompt", "text"}``), which the reporting
callback writes as a ``samples`` row of ``metrics.jsonl``.
"""

from __future__ import annotations

import logging

from lmrecipe.config import due_at
from lmrecipe.errors import fail
from lmrecipe.evaluation.evaluate import greedy_continuation
from lmrecipe.model.loss import validation_loss
from lmrecipe.parallel.accelerator import unwrap_model
from lmrecipe.train.setup import Run

logger = logging.getLogger(__name__)

SAMPLES = "samples"
"""The figure (and ``metrics.jsonl`` row key) that carries the generated texts."""


class Validation:
    """The run's validation sets and prompts: when an evaluation is due, and what it measures."""

    def __init__(self, run: Run):
        self.run = run
        self.every_steps = run.cfg.train.eval_every_steps
        self.max_steps = run.cfg.train.max_steps
        self.samples = PromptSamples(run) if run.cfg.eval.samples else None

    def due(self, step: int) -> bool:
        """Whether optimizer step ``step`` (1-based) ends with an evaluation."""
        return due_at(step, self.every_steps, self.max_steps)

    def losses(self) -> dict[str, float]:
        """The validation loss of each source's windows, of the weights the model holds now."""
        run = self.run
        return {name: validation_loss(run.model, batches, run.accelerator, run.attention)
                for name, batches in run.data.val_sets.items()}

    def loss(self, per_source: dict[str, float] | None = None) -> float:
        """The run's validation loss (a mixture's weighted over its sources) of ``per_source`` or of the weights now."""
        return self.run.data.val_loss(self.losses() if per_source is None else per_source)

    @property
    def is_mixture(self) -> bool:
        return self.run.data.is_mixture

    def generate(self, step: int) -> dict[str, list]:
        """``eval.samples``' continuations as a figure (empty without prompts)."""
        return {} if self.samples is None else {SAMPLES: self.samples.generate(step)}


class PromptSamples:
    """``eval.samples`` tokenized once at the start (a prompt too long for the model stops the run before its first
    step), and continued greedily at each evaluation."""

    def __init__(self, run: Run):
        from transformers import AutoTokenizer

        section = run.cfg.eval
        self.model, self.accelerator, self.attention = run.model, run.accelerator, run.attention
        self.new_tokens = section.sample_tokens
        self.tokenizer = AutoTokenizer.from_pretrained(run.data.tokenizer_dir)
        self.prompts = [(prompt, self.tokenizer(prompt, add_special_tokens=False).input_ids) for prompt in section.samples]
        room = unwrap_model(self.accelerator, self.model).config.max_position_embeddings
        for i, (prompt, ids) in enumerate(self.prompts):
            if not ids or len(ids) + self.new_tokens > room:
                raise fail(f"eval.samples[{i}]={prompt!r} is {len(ids)} tokens and eval.sample_tokens="
                           f"{self.new_tokens}: the model holds {room} positions (data.seq_len). Shorten the prompt or "
                           "lower eval.sample_tokens.")

    def generate(self, step: int) -> list[dict[str, str]]:
        out = []
        for prompt, ids in self.prompts:
            tokens = greedy_continuation(self.model, ids, self.new_tokens, self.tokenizer.eos_token_id,
                                         self.accelerator.device, self.attention)
            out.append({"prompt": prompt, "text": self.tokenizer.decode(tokens, skip_special_tokens=True)})
        if self.accelerator.is_main_process:
            for sample in out:
                logger.info("sample at step %d: %r -> %r", step, sample["prompt"], sample["text"])
        return out
