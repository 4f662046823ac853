"""Scoring a model: the validation loss and perplexity of an export or checkpoint (``evaluate``, what ``eval.py``
runs), the multiple-choice tasks (``tasks``) and EleutherAI's lm-evaluation-harness (``lm_eval``)."""
