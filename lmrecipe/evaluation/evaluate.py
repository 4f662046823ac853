"""Validation loss and perplexity of an export or a training checkpoint, its multiple-choice tasks' accuracy, and
sampling a continuation; the greedy continuations of a training run's ``eval.samples``.

The windows are the same ``ValBatches`` the training run evaluates, split over however many processes run
and summed with one all-reduce, so 1 and N processes report the same loss (up to float summation order).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from pathlib import Path

import torch

from lmrecipe.model.attention import DocumentAttention, build_document_attention
from lmrecipe.model.linear_attention import install_per_document, remove_per_document
from lmrecipe.config import TrainConfig
from lmrecipe.data.batches import ValBatches
from lmrecipe.data.format import TokenWindows, load_meta
from lmrecipe.data.tokenizer import check_same_tokenizer, tokenizer_name
from lmrecipe.parallel.accelerator import build_eval_accelerator
from lmrecipe.errors import UserError, fail
from lmrecipe.export import load_for_inference
from lmrecipe.model.loss import forward_kwargs, use_chunked_loss, validation_loss
from lmrecipe.evaluation.tasks import NEXT_LINE, describe, prepare_tasks, resolve_tasks, score_tasks, single_documents

logger = logging.getLogger(__name__)


def evaluate_path(
    path: str | Path,
    data_dir: str | Path | Sequence[str | Path],
    max_batches: int | None = None,
    batch_size: int = 8,
    seq_len: int | None = None,
    generate: str | None = None,
    max_new_tokens: int = 64,
    seed: int = 0,
    weights: str = "raw",
    document_masking: bool = True,
    allow_other_tokenizer: bool = False,
    source_weights: Sequence[float] | None = None,
) -> tuple[dict, bool]:
    """Evaluate ``path`` (export folder or training checkpoint) on the val split of ``data_dir``, or of each folder of
    a mixture (a list of folders).

    Args:
        max_batches: evaluate at most this many batches of ``batch_size`` windows (spread over val.bin,
            the same set for any process count); None evaluates every window.
        batch_size: windows per forward pass on each process.
        seq_len: tokens per window; None uses the training seq_len (a checkpoint's recipe, an export's
            ``max_position_embeddings``).
        generate: a prompt to sample a continuation of (main process only), seeded by ``seed``.
        weights: a checkpoint's trained weights (``raw``) or their moving average (``ema``).
        document_masking: each token attends only to its own document, positions restarting at each document (as
            training with ``data.document_masking`` does); False evaluates the windows as one stream each.
        allow_other_tokenizer: evaluate data whose ``tokenizer.json`` differs from the model's (a UserError
            otherwise: its ids fit the vocabulary but mean other text).
        source_weights: a mixture's weights, one per folder (default: equal). As in training, the mixture's loss is
            the weight-averaged mean of the folders' losses, folders of weight 0 reported and left out of it.

    Returns:
        ``({"loss", "perplexity", "tokens", "document_masking"[, "sources"][, "prompt", "continuation"]},
        is_main_process)``; ``sources`` (a mixture only) holds each folder's ``loss``, ``perplexity``, ``tokens`` and
        normalised ``weight`` under its folder name.
    """
    for name, value in (("--max-batches", max_batches), ("--batch-size", batch_size), ("--seq-len", seq_len),
                        ("--max-new-tokens", max_new_tokens)):
        if value is not None and value <= 0:
            raise fail(f"{name}={value} must be positive.")
    data_dirs = [Path(data_dir)] if isinstance(data_dir, (str, Path)) else [Path(d) for d in data_dir]
    shares = mixture_weights(data_dirs, source_weights)
    accelerator = build_eval_accelerator()
    metas = [load_meta(d) for d in data_dirs]  # a wrong data folder fails before the model is loaded
    model, tokenizer, trained_seq_len = load_for_inference(path, weights=weights)
    seq_len = seq_len or trained_seq_len
    if seq_len > model.config.max_position_embeddings:
        raise fail(f"--seq-len={seq_len} exceeds the model's max_position_embeddings={model.config.max_position_embeddings}.")
    model.to(accelerator.device)
    if chunk_tokens := TrainConfig().chunk_tokens(model.config.vocab_size):  # large vocabularies: no full logits
        use_chunked_loss(model, chunk_tokens)

    sets = []
    for folder, meta in zip(data_dirs, metas):
        val = TokenWindows(folder, "val", seq_len, meta)
        check_tokenizer(folder, meta, model, tokenizer, allow_other_tokenizer)
        n_windows = len(val) if max_batches is None else min(len(val), max_batches * batch_size)
        sets.append(ValBatches(val, n_windows, batch_size, accelerator.num_processes, accelerator.process_index,
                               documents=document_masking))
    attention = masking_attention(model) if document_masking else None
    losses = [validation_loss(model, batches, accelerator, attention) for batches in sets]
    if attention is not None:
        model.set_attn_implementation(attention.requested)  # generation below runs the stock attention
        remove_per_document(model)
    tokens = [int(len(batches.all_ids) * seq_len) for batches in sets]
    loss = sum(w * x for w, x in zip(shares, losses) if w > 0)
    result = {"loss": loss, "perplexity": perplexity(loss), "tokens": sum(tokens), "document_masking": document_masking}
    if len(data_dirs) > 1:
        result["sources"] = {folder.name: {"loss": x, "perplexity": perplexity(x), "tokens": n, "weight": w}
                             for folder, x, n, w in zip(data_dirs, losses, tokens, shares)}
    for folder, batches, x in zip(data_dirs, sets, losses):
        logger.info("%s: %d windows of %d tokens on %d processes, document masking %s: loss %.6f", folder,
                    len(batches.all_ids), seq_len, accelerator.num_processes, "on" if document_masking else "off", x)
    if generate is not None and accelerator.is_main_process:
        result.update(prompt=generate, continuation=sample(model, tokenizer, generate, max_new_tokens, seed))
    return result, accelerator.is_main_process


def evaluate_tasks(
    path: str | Path,
    specs: Sequence[str],
    data_dir: str | Path | None = None,
    batch_size: int = 8,
    weights: str = "raw",
    next_line_items: int = 100,
    seed: int = 0,
) -> tuple[dict, bool]:
    """Score the multiple-choice tasks ``specs`` (task files, or ``next_line`` built from ``data_dir``'s validation
    split) on ``path`` (export folder or training checkpoint), items split over the processes (``lmrecipe/evaluation/tasks.py``).

    Returns ``({task: {"acc", "acc_norm", "items", "chance"}}, is_main_process)``, the same on any number of processes.
    """
    if batch_size <= 0:
        raise fail(f"--batch-size={batch_size} must be positive.")
    files = resolve_tasks([s for s in specs if s != NEXT_LINE], None, next_line_items, seed)  # before the model
    accelerator = build_eval_accelerator()
    model, tokenizer, _ = load_for_inference(path, weights=weights)
    tasks = resolve_tasks(specs, data_dir, next_line_items, seed, model.config.max_position_embeddings) \
        if NEXT_LINE in specs else files
    model.to(accelerator.device)
    if chunk_tokens := TrainConfig().chunk_tokens(model.config.vocab_size):  # as in evaluate_path
        use_chunked_loss(model, chunk_tokens)
    prepared = prepare_tasks(tasks, tokenizer, model.config.max_position_embeddings)
    logger.info("Scoring %s on %d processes", describe(tasks), accelerator.num_processes)
    return score_tasks(model, prepared, accelerator, batch_size), accelerator.is_main_process


def perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 700 else float("inf")


def mixture_weights(data_dirs: list[Path], source_weights: Sequence[float] | None) -> list[float]:
    """The folders' weights normalised to sum to 1 (equal when not given); UserError naming the fix if they cannot be."""
    names = [d.name for d in data_dirs]
    if len(set(names)) != len(names):
        raise fail(f"--data names two folders of the same name ({', '.join(map(str, data_dirs))}): the result reports "
                   "each folder by its name. Give each folder of a mixture its own name.")
    if source_weights is None:
        return [1.0 / len(data_dirs)] * len(data_dirs)
    if len(source_weights) != len(data_dirs):
        raise fail(f"--source-weights has {len(source_weights)} values for {len(data_dirs)} --data folders: give one "
                   "weight per folder, in the same order.")
    if any(not math.isfinite(w) or w < 0 for w in source_weights) or sum(source_weights) <= 0:
        raise fail(f"--source-weights {' '.join(map(str, source_weights))}: weights must be finite numbers >= 0, at "
                   "least one positive (0 evaluates a folder without counting it in the mixture's loss).")
    total = sum(source_weights)
    return [w / total for w in source_weights]


def check_tokenizer(data_dir: Path, meta: dict, model, tokenizer, allow_other_tokenizer: bool) -> None:
    """UserError unless ``data_dir``'s ids fit the model and were made by its tokenizer (or that is allowed)."""
    vocab = model.config.vocab_size
    top = int(meta["splits"]["val"]["max_token_id"])
    if int(meta["vocab_size"]) > vocab or top >= vocab:
        raise fail(f"{data_dir} was tokenized with a vocabulary of {meta['vocab_size']} tokens (largest id "
                   f"{top}) but the model has {vocab}: it was prepared with another tokenizer.")
    if model_dir := getattr(tokenizer, "name_or_path", ""):
        check_same_tokenizer(
            model_dir, data_dir, allow=allow_other_tokenizer,
            what=f"{tokenizer_name(data_dir)} was prepared with another tokenizer than the model's, {model_dir}",
            fix=f"Its ids fit the vocabulary, so the loss would be computed, and meaningless. Prepare the data with the "
                f"model's tokenizer (tools/prepare_data.py --tokenizer {model_dir}), or pass --allow-other-tokenizer if "
                "the two encode alike.")


def masking_attention(model) -> DocumentAttention:
    """Switch ``model`` to the document-masking variant of its attention implementation, its linear-attention
    layers run per document (refused with a message naming ``--no-document-masking`` for a model that cannot
    mask)."""
    requested = model.config._attn_implementation or "sdpa"
    try:
        attention = build_document_attention(requested, model.config)
    except UserError as err:
        raise fail(f"{err} To evaluate the windows as plain streams instead, pass --no-document-masking.") from None
    model.set_attn_implementation(attention.name)
    if attention.linear_attention:
        install_per_document(model)
    return attention


@torch.no_grad()
def sample(model, tokenizer, prompt: str, max_new_tokens: int, seed: int) -> str:
    """A seeded sampled continuation of ``prompt`` (top-k 50, temperature 1), without the prompt."""
    device = next(model.parameters()).device
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids.to(device)
    room = model.config.max_position_embeddings - ids.shape[1]
    if ids.shape[1] == 0 or room <= 0:
        raise fail(f"--generate needs a prompt of 1 to {model.config.max_position_embeddings - 1} tokens; "
                   f"this one has {ids.shape[1]}.")
    torch.manual_seed(seed)
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=True, top_k=50, temperature=1.0,
        max_new_tokens=min(max_new_tokens, room), eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
    )
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


@torch.no_grad()
def greedy_continuation(model, prompt_ids: Sequence[int], new_tokens: int, eos_id: int | None, device,
                        attention: DocumentAttention | None = None) -> list[int]:
    """The ``new_tokens`` most likely next tokens after ``prompt_ids``, one at a time (greedy decoding, no cache), cut
    before the first ``eos_id``: what ``generate(do_sample=False)`` gives on the same weights.

    ``model`` may be the prepared one of a run (DDP, any ZeRO stage): every rank that calls this with the same
    arguments runs the same ``new_tokens`` forwards, EOS or not, so ZeRO-3's gathers meet on every rank.
    ``attention``: the document-masking attention the model runs (the sequence is one document).
    """
    was_training = model.training
    model.eval()
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)
    for _ in range(new_tokens):
        kwargs = forward_kwargs(attention, single_documents(1, ids.shape[1]), device) if attention else {}
        logits = model(input_ids=ids, **kwargs).logits
        ids = torch.cat([ids, logits[:, -1].argmax(dim=-1, keepdim=True)], dim=1)
    model.train(was_training)
    out = ids[0, len(prompt_ids):].tolist()  # the one host read
    return out[:out.index(eos_id)] if eos_id in out else out
