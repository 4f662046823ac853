"""Multiple-choice tasks scored by log-likelihood, as lm-evaluation-harness scores them.

A task file is JSON lines, one item per line: ``{"context": str, "choices": [str, ...], "gold": int}`` (other keys,
such as an ``id``, are kept out of the way). The model scores each choice as the continuation of the context: the
summed log-probability of the continuation's tokens. ``acc`` counts an item right when the gold choice has the
highest sum; ``acc_norm`` when it has the highest sum per character of the choice (lm-eval's ``acc_norm``, which
divides by ``len(choice)``; its separate ``acc_bytes`` divides by UTF-8 bytes). Choices are appended to the context
as they are (lm-eval's ``target_delimiter: ""``), so a choice that follows a space carries it.

Tokenization follows lm-eval's ``HFLM`` (``_encode_pair``): trailing whitespace of the context moves to the front of
the continuation, ``context + continuation`` is encoded whole, the continuation's tokens are those after the first
``len(encode(context))``, and the sequence is ``encode(context)`` followed by them; ``encode`` adds the tokenizer's
special tokens as ``HFLM`` does by default. A sequence longer than the model's ``max_position_embeddings`` keeps its
last tokens. So our scores equal lm-eval's on the same task (``tests/unit/test_tasks.py`` holds them to 1e-4).

``next_line`` is a task built from the validation split of a prepared folder, with no download: the true next line
of a held-out document against lines of other documents, the same for a given folder and seed.

Items are split over ranks; every rank runs the same number of forward passes (ZeRO-3 gathers parameters in
forward) and the counts are summed with one all-reduce, so 1 and N processes report the same accuracy.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from lmrecipe.model.attention import DocumentAttention
from lmrecipe.data.documents import DocumentBatch
from lmrecipe.data.format import load_meta
from lmrecipe.errors import fail
from lmrecipe.fileio import write_text_atomic
from lmrecipe.model.loss import causal_lm_loss, forward_kwargs

logger = logging.getLogger(__name__)

NEXT_LINE = "next_line"
"""The task spec of the next-line task built from a prepared folder's validation split."""
TASK_FIELDS = ("context", "choices", "gold")


@dataclass(frozen=True)
class Item:
    context: str
    choices: tuple[str, ...]
    gold: int


@dataclass(frozen=True)
class Task:
    name: str
    items: tuple[Item, ...]

    def chance(self) -> float:
        """Expected accuracy of a uniform guess: the mean of 1 / choices over the items."""
        return sum(1.0 / len(item.choices) for item in self.items) / len(self.items)


# ---------------------------------------------------------------------------------------------- task files


def load_task_file(path: str | Path) -> Task:
    """The task in ``path`` (named after the file's stem); UserError naming the file and line of a bad item."""
    path = Path(path)
    if path.is_dir():
        inside = sorted(str(p) for p in path.glob("*.jsonl"))[:3]
        hint = f" (it holds {', '.join(inside)}: pass those files)" if inside else ""
        raise fail(f"Task {path} is a folder, not a task file{hint}. Give JSON-lines task files, one item of "
                   f"{{\"context\": ..., \"choices\": [...], \"gold\": index}} per line, or {NEXT_LINE} (built from "
                   "the data folder's validation split); a folder of lm-eval task YAML files goes to --include-path.")
    if not path.is_file():
        raise fail(f"Task file {path} does not exist. Give a JSON-lines file of {{\"context\": ..., \"choices\": [...], "
                   f"\"gold\": index}} items, or {NEXT_LINE} (built from the data folder's validation split).")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as err:
        raise fail(f"Task file {path} is not UTF-8 text ({err}).") from None
    items = [parse_item(line, path, number) for number, line in enumerate(lines, start=1) if line.strip()]
    if not items:
        raise fail(f"Task file {path} holds no items: write one JSON object per line, e.g. "
                   '{"context": "2 + 2 =", "choices": [" 4", " 5"], "gold": 0}.')
    return Task(path.stem, tuple(items))


def parse_item(line: str, path: Path, number: int) -> Item:
    where = f"{path}, line {number}"
    example = 'e.g. {"context": "2 + 2 =", "choices": [" 4", " 5"], "gold": 0}'
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise fail(f"{where} is not JSON ({err.msg}): write one item per line, {example}.") from None
    if not isinstance(record, dict):
        raise fail(f"{where} is not a JSON object: write one item per line, {example}.")
    missing = [key for key in TASK_FIELDS if key not in record]
    if missing:
        raise fail(f"{where} lacks {', '.join(repr(k) for k in missing)}: every item needs "
                   f"{', '.join(TASK_FIELDS)}, {example}.")
    context, choices, gold = (record[key] for key in TASK_FIELDS)
    if not isinstance(context, str) or not context.strip():
        raise fail(f"{where}: \"context\" must be a string with some text other than whitespace (got {context!r}); "
                   "lm-eval moves a context's trailing whitespace to the continuation and needs the rest.")
    if not isinstance(choices, list) or len(choices) < 2:
        raise fail(f"{where}: \"choices\" must be a list of at least two strings (got {choices!r}).")
    bad = [i for i, choice in enumerate(choices) if not isinstance(choice, str) or not choice]
    if bad:
        raise fail(f"{where}: choice {bad[0]} is {choices[bad[0]]!r}; every choice must be a non-empty string.")
    if isinstance(gold, bool) or not isinstance(gold, int) or not 0 <= gold < len(choices):
        raise fail(f"{where}: \"gold\" is {gold!r} but must be the index of the right choice, an integer from 0 to "
                   f"{len(choices) - 1}.")
    return Item(context, tuple(choices), gold)


def write_task_file(task: Task, path: str | Path) -> Path:
    """Write ``task`` as a task file (atomically), readable by :func:`load_task_file` and by lm-eval."""
    text = "".join(json.dumps({"context": item.context, "choices": list(item.choices), "gold": item.gold}) + "\n"
                   for item in task.items)
    write_text_atomic(path, text)
    return Path(path)


def lm_eval_task_config(name: str, task_file: Path, cache_dir: Path) -> dict:
    """An lm-eval task configuration (its YAML's content) that reads ``task_file`` as this module scores it."""
    return {
        "task": name,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(Path(task_file).resolve())}, "cache_dir": str(cache_dir)},
        "test_split": "test",
        "output_type": "multiple_choice",
        "doc_to_text": "context",
        "doc_to_choice": "choices",
        "doc_to_target": "gold",
        "target_delimiter": "",
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True},
                        {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True}],
    }


def resolve_tasks(specs: Sequence[str], data_dir: str | Path | None, n_items: int, seed: int,
                  max_length: int | None = None) -> list[Task]:
    """Each spec as a task: a task file, or :data:`NEXT_LINE` built from ``data_dir``'s validation split (for a model
    of ``max_length`` positions, see :func:`next_line_task`). UserError for a missing file, a bad item, two tasks of
    one name, or ``next_line`` without a folder."""
    tasks = []
    for spec in specs:
        if spec == NEXT_LINE:
            if data_dir is None:
                raise fail(f"The task {NEXT_LINE} is built from a prepared folder's validation split: pass --data DIR.")
            tasks.append(next_line_task(data_dir, n_items=n_items, seed=seed,
                                        max_line_tokens=None if max_length is None else max_length // 2))
        else:
            tasks.append(load_task_file(spec))
    names = [task.name for task in tasks]
    if len(set(names)) != len(names):
        raise fail(f"Two tasks share a name ({', '.join(names)}); a task is named after its file's stem. Rename one.")
    return tasks


# ---------------------------------------------------------------------------------------------- next_line


MIN_LINE_CHARS = 8
"""A line is a candidate (an answer or a distractor) when it holds at least this many non-space characters..."""
MAX_LINE_CHARS = 100
"""...and at most this many characters."""
CONTEXT_LINES = 6
CONTEXT_CHARS = 300
"""The context is the lines before the answer: at most CONTEXT_LINES of them, at most CONTEXT_CHARS characters."""


def next_line_task(data_dir: str | Path, n_items: int = 100, n_choices: int = 4, seed: int = 0,
                   max_line_tokens: int | None = None) -> Task:
    """``n_items`` items from the validation documents of ``data_dir``: a document's preceding lines, then its true
    next line against ``n_choices - 1`` lines of other documents (in a seeded random order). Deterministic in
    (folder, ``n_items``, ``n_choices``, ``seed``, ``max_line_tokens``). ``max_line_tokens``: lines (with the
    newline before them) of more tokens than this are neither answers nor distractors (a model reads the
    continuation whole; half its positions leave room for the context)."""
    from transformers import AutoTokenizer

    data_dir = Path(data_dir)
    meta = load_meta(data_dir)
    if n_items < 1 or n_choices < 2:
        raise fail(f"The {NEXT_LINE} task needs at least one item and two choices (got {n_items} and {n_choices}).")
    tokenizer = AutoTokenizer.from_pretrained(data_dir)
    documents = val_documents(data_dir, meta, tokenizer)
    lines = [text.split("\n") for text in documents]
    candidates = [(d, k) for d, doc in enumerate(lines) for k in range(1, len(doc)) if _candidate(doc[k])
                  and doc[k - 1].strip()]
    if max_line_tokens is not None and candidates:
        lengths = tokenizer(["\n" + lines[d][k].rstrip() for d, k in candidates], add_special_tokens=False).input_ids
        candidates = [c for c, ids in zip(candidates, lengths) if len(ids) <= max_line_tokens]
    if len({d for d, _ in candidates}) < 2:
        raise fail(f"{data_dir}'s validation split has too few documents with lines of code or text to build the "
                   f"{NEXT_LINE} task (it needs two or more): prepare it with a larger --val-fraction.")
    rng = np.random.default_rng(seed)
    picks = rng.permutation(len(candidates))[:n_items]
    items = [_next_line_item(lines, candidates, *candidates[i], n_choices, rng) for i in sorted(picks)]
    if len(items) < n_items:
        logger.warning("%s: %d %s items asked for, the validation split holds %d", data_dir, n_items, NEXT_LINE,
                       len(items))
    return Task(NEXT_LINE, tuple(items))


def val_documents(data_dir: Path, meta: dict, tokenizer) -> list[str]:
    """The validation split's documents as text (each without its end-of-document token)."""
    tokens = np.fromfile(data_dir / "val.bin", dtype=np.dtype(meta["dtype"]))
    starts = np.fromfile(data_dir / "val.idx", dtype=np.uint64).astype(np.int64)
    eos = int(meta["eos_id"])
    texts = []
    for start, end in zip(starts[:-1], starts[1:]):
        ids = tokens[start:end]
        if len(ids) and ids[-1] == eos:
            ids = ids[:-1]
        texts.append(tokenizer.decode(ids.tolist()))
    return texts


def _candidate(line: str) -> bool:
    return len(line.strip()) >= MIN_LINE_CHARS and len(line.rstrip()) <= MAX_LINE_CHARS


def _next_line_item(lines: list[list[str]], candidates: list[tuple[int, int]], doc: int, k: int, n_choices: int,
                    rng: np.random.Generator) -> Item:
    before: list[str] = []
    for line in reversed(lines[doc][max(0, k - CONTEXT_LINES):k]):
        if before and sum(len(x) + 1 for x in before) + len(line) + 1 > CONTEXT_CHARS:
            break
        before.insert(0, line)
    context = "".join(line + "\n" for line in before)
    answer = lines[doc][k].rstrip()
    choices = [answer]
    for i in rng.permutation(len(candidates)):
        other_doc, other_k = candidates[i]
        line = lines[other_doc][other_k].rstrip()
        if other_doc != doc and line not in choices:
            choices.append(line)
            if len(choices) == n_choices:
                break
    order = rng.permutation(len(choices))
    return Item(context, tuple(choices[i] for i in order), int(np.flatnonzero(order == 0)[0]))


# ---------------------------------------------------------------------------------------------- scoring


@dataclass(frozen=True)
class Request:
    """One (item, choice): the tokens of the forward pass and how many of its last targets are the continuation."""

    tokens: tuple[int, ...]
    continuation_tokens: int


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """Context and continuation tokens as lm-eval's ``HFLM._encode_pair`` makes them (see the module docstring)."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    whole = tokenizer.encode(context + continuation)
    context_ids = tokenizer.encode(context)
    # The context keeps its own encoding even where the whole one splits differently at the seam, as in lm-eval.
    return context_ids, whole[len(context_ids):]


@dataclass(frozen=True)
class PreparedTasks:
    """The tasks tokenized once for a model of ``max_length`` positions (an evaluation in the loop reuses them)."""

    tasks: tuple[Task, ...]
    requests: tuple[Request, ...]
    item_index: tuple[tuple[int, int], ...]
    """Each item's (task, item of the task); items are numbered over all tasks, in order."""
    item_requests: tuple[tuple[int, ...], ...]
    """Each item's requests, in choice order."""


def prepare_tasks(tasks: Sequence[Task], tokenizer, max_length: int) -> PreparedTasks:
    requests, item_index, item_requests = [], [], []
    for t, task in enumerate(tasks):
        for i, item in enumerate(task.items):
            first = len(requests)
            for choice in item.choices:
                context_ids, continuation_ids = encode_pair(tokenizer, item.context, choice)
                if not context_ids or not continuation_ids or len(continuation_ids) > max_length:
                    raise fail(f"Task {task.name}, item {i + 1}: the choice {choice!r} encodes to "
                               f"{len(continuation_ids)} tokens after a context of {len(context_ids)} (needs at least "
                               f"one of each, and at most {max_length} continuation tokens); lm-eval refuses it too.")
                # lm-eval's left truncation: the last max_length + 1 tokens, of which the model reads all but one.
                tokens = (context_ids + continuation_ids)[-(max_length + 1):]
                requests.append(Request(tuple(tokens), len(continuation_ids)))
            item_index.append((t, i))
            item_requests.append(tuple(range(first, len(requests))))
    return PreparedTasks(tuple(tasks), tuple(requests), tuple(item_index), tuple(item_requests))


def rank_requests(prepared: PreparedTasks, world_size: int, rank: int) -> tuple[list[int], int]:
    """This rank's requests (of the items ``rank::world_size``) and the number of forward rows every rank runs."""
    n_items = len(prepared.item_index)
    counts = [sum(len(prepared.item_requests[i]) for i in range(r, n_items, world_size)) for r in range(world_size)]
    mine = [q for i in range(rank, n_items, world_size) for q in prepared.item_requests[i]]
    return mine, max(counts)


@torch.no_grad()
def score_tasks(model, prepared: PreparedTasks, accelerator, batch_size: int,
                attention: DocumentAttention | None = None) -> dict[str, dict]:
    """Accuracy of ``model`` on the prepared tasks: ``{task: {"acc", "acc_norm", "items", "chance"}}``, the same on
    any number of processes (one all-reduce). ``attention``: the document-masking attention the model runs (each
    sequence is one document)."""
    was_training = model.training
    model.eval()
    mine, rows = rank_requests(prepared, accelerator.num_processes, accelerator.process_index)
    padded = mine + [mine[0] if mine else 0] * (rows - len(mine))  # padding rows are scored and dropped
    scores = [loglikelihoods(model, [prepared.requests[q] for q in padded[i:i + batch_size]], accelerator.device,
                             attention) for i in range(0, rows, batch_size)]
    model.train(was_training)
    loglik = dict(zip(mine, torch.cat(scores).tolist() if scores else []))  # the one host read
    totals = torch.zeros(len(prepared.tasks), 2, dtype=torch.float64)
    for i in range(accelerator.process_index, len(prepared.item_index), accelerator.num_processes):
        t, k = prepared.item_index[i]
        item = prepared.tasks[t].items[k]
        sums = np.array([loglik[q] for q in prepared.item_requests[i]])
        lengths = np.array([float(len(choice)) for choice in item.choices])  # characters, as lm-eval's acc_norm
        totals[t, 0] += float(np.argmax(sums) == item.gold)
        totals[t, 1] += float(np.argmax(sums / lengths) == item.gold)
    totals = accelerator.reduce(totals.to(accelerator.device), reduction="sum").cpu()
    return {task.name: {"acc": totals[t, 0].item() / len(task.items), "acc_norm": totals[t, 1].item() / len(task.items),
                        "items": len(task.items), "chance": task.chance()}
            for t, task in enumerate(prepared.tasks)}


def loglikelihoods(model, requests: list[Request], device, attention: DocumentAttention | None) -> torch.Tensor:
    """Summed log-probability of each request's continuation tokens (float64, on ``device``), in one forward of
    the requests padded on the right (a causal model's earlier positions do not see the padding)."""
    width = max(len(r.tokens) for r in requests) - 1
    tokens = torch.zeros(len(requests), width + 1, dtype=torch.long)
    continuation = torch.zeros(len(requests), width, dtype=torch.bool)
    for row, request in enumerate(requests):
        n = len(request.tokens)
        tokens[row, :n] = torch.tensor(request.tokens)
        continuation[row, n - 1 - request.continuation_tokens:n - 1] = True
    inputs, targets = tokens[:, :-1].to(device), tokens[:, 1:].to(device)
    kwargs = forward_kwargs(attention, single_documents(len(requests), width), device) if attention else {}
    per_token = causal_lm_loss(model, inputs, targets, "none", kwargs)
    return -(per_token.double() * continuation.to(device)).sum(dim=1)


def single_documents(rows: int, width: int) -> DocumentBatch:
    """Document boundaries of a batch whose every row is one document starting at position 0."""
    return DocumentBatch(position_ids=torch.arange(width).expand(rows, width).contiguous(),
                         document_ids=torch.zeros(rows, width, dtype=torch.int32),
                         cu_seqlens=torch.arange(0, rows * width + 1, width, dtype=torch.int32), max_seqlen=width)


def flat_metrics(results: dict[str, dict]) -> dict[str, float]:
    """Task results as metrics-row keys: ``acc/<task>``, ``acc_norm/<task>``, ``chance/<task>``."""
    return {f"{key}/{name}": result[key] for name, result in results.items() for key in ("acc", "acc_norm", "chance")}


def describe(tasks: Sequence[Task]) -> str:
    return ", ".join(f"{task.name} ({len(task.items)} items, chance {100 * task.chance():.1f} %)" for task in tasks)
