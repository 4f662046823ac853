"""Multiple-choice tasks: lm-eval agrees with our scorer, task files are checked, next_line is built as promised."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from lmrecipe.model.attention import build_document_attention
from lmrecipe.config import load_config
from lmrecipe.parallel.accelerator import build_eval_accelerator
from lmrecipe.errors import UserError
from lmrecipe.evaluation.lm_eval import lm_eval_results
from lmrecipe.observe.run_report import task_table
from lmrecipe.evaluation.tasks import (Item, Task, encode_pair, load_task_file, loglikelihoods, next_line_task, prepare_tasks,
                            rank_requests, score_tasks, val_documents, write_task_file)

MAX_LENGTH = 48
# Whitespace at the end of a context moves to the continuation (lm-eval's rule); choices with and without a space.
HANDMADE = [
    Item("def add(a, b):\n    return ", ("a + b", "a - b", "None"), 0),
    Item("import os\nimport ", ("sys", " sys", "os.path"), 0),
    Item("for i in range(10):\n", ("    print(i)", "print(i)", "    pass"), 0),
    Item("class A:\n    def __init__(self):\n        self.x = 1\n\n", ("class B:", "    def f(self):"), 1),
    Item("x = [1, 2, 3]  \t", ("# a list", "x.append(4)"), 1),
]


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_data):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=384, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                         intermediate_size=128, max_position_embeddings=MAX_LENGTH)).eval()
    return model, AutoTokenizer.from_pretrained(tiny_data)


@pytest.fixture(scope="module")
def tasks(tiny_data) -> list[Task]:
    return [next_line_task(tiny_data, n_items=24, seed=1, max_line_tokens=MAX_LENGTH // 2), Task("handmade", tuple(HANDMADE))]


def test_our_scores_agree_with_lm_eval_on_the_same_local_tasks(tasks, model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    prepared = prepare_tasks(tasks, tokenizer, MAX_LENGTH)
    ours = score_tasks(model, prepared, build_eval_accelerator(), batch_size=8)
    # lm-eval itself (HFLM), reading the tasks from the task files and configurations eval.py --lm-eval writes.
    output = lm_eval_results(model, tokenizer, [], tasks, batch_size=16, log_samples=True)
    ours_loglik = loglikelihoods(model, list(prepared.requests), "cpu", None).tolist()
    for t, task in enumerate(tasks):
        theirs = output["results"][task.name]
        print(f"{task.name}: ours acc {ours[task.name]['acc']:.4f} acc_norm {ours[task.name]['acc_norm']:.4f}; "
              f"lm-eval acc {theirs['acc,none']:.4f} acc_norm {theirs['acc_norm,none']:.4f}")
        assert ours[task.name]["acc"] == pytest.approx(theirs["acc,none"], abs=1e-4)
        assert ours[task.name]["acc_norm"] == pytest.approx(theirs["acc_norm,none"], abs=1e-4)
        samples = sorted(output["samples"][task.name], key=lambda s: s["doc_id"])
        assert len(samples) == len(task.items)
        first = sum(len(item.choices) for earlier in tasks[:t] for item in earlier.items)
        theirs_loglik = [resp[0][0] for s in samples for resp in s["resps"]]
        mine = ours_loglik[first:first + len(theirs_loglik)]
        assert np.allclose(mine, theirs_loglik, rtol=1e-5, atol=1e-4), max(abs(a - b) for a, b in zip(mine, theirs_loglik))
    assert 0.0 <= ours["next_line"]["acc"] <= 1.0 and ours["next_line"]["chance"] == 0.25


def test_the_continuation_takes_the_contexts_trailing_whitespace(model_and_tokenizer):
    _, tokenizer = model_and_tokenizer
    context, continuation = encode_pair(tokenizer, "import os\nimport ", "sys")
    assert tokenizer.decode(continuation) == " sys" and tokenizer.decode(context) == "import os\nimport"
    assert context == tokenizer.encode("import os\nimport")
    assert continuation == tokenizer.encode("import os\nimport sys")[len(context):]


def test_document_masking_and_rank_splits_give_the_same_scores(tasks, model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    prepared = prepare_tasks([Task("some", tasks[0].items[:6]), tasks[1]], tokenizer, MAX_LENGTH)
    plain = loglikelihoods(model, list(prepared.requests), "cpu", None)
    attention = build_document_attention("sdpa", model.config)
    model.set_attn_implementation(attention.name)
    try:
        masked = loglikelihoods(model, list(prepared.requests), "cpu", attention)
    finally:
        model.set_attn_implementation("sdpa")
    assert torch.allclose(plain, masked, rtol=1e-5, atol=1e-4)
    # Three ranks: each request on exactly one rank, and every rank runs the same number of forward rows.
    shares = [rank_requests(prepared, 3, rank) for rank in range(3)]
    assert sorted(q for mine, _ in shares for q in mine) == list(range(len(prepared.requests)))
    assert len({rows for _, rows in shares}) == 1 and shares[0][1] == max(len(mine) for mine, _ in shares)


def test_next_line_is_deterministic_and_its_answers_are_the_true_next_lines(tiny_data):
    task = next_line_task(tiny_data, n_items=25, seed=3)
    assert task == next_line_task(tiny_data, n_items=25, seed=3)
    assert task != next_line_task(tiny_data, n_items=25, seed=4)
    texts = val_documents(tiny_data, json.loads((tiny_data / "meta.json").read_text()),
                          AutoTokenizer.from_pretrained(tiny_data))
    assert len(task.items) == 25 and task.chance() == 0.25
    for item in task.items:
        assert len(item.choices) == 4 and len(set(item.choices)) == 4
        true_text = item.context + item.choices[item.gold]
        homes = [d for d, text in enumerate(texts) if true_text in text]
        assert homes, item  # the context followed by the answer is a passage of a held-out document
        others = [c for i, c in enumerate(item.choices) if i != item.gold]
        assert all(not any(item.context + c in texts[d] for d in homes) for c in others)
    golds = [item.gold for item in task.items]
    assert len(set(golds)) > 1  # the answer's place is shuffled


BAD_FILES = {
    "missing gold": ('{"context": "a b", "choices": ["c", "d"]}\n', 1, "lacks 'gold'"),
    "no choices": ('{"context": "a", "choices": ["x", "y"], "gold": 0}\n{"context": "a", "choices": [], "gold": 0}\n',
                   2, "at least two strings"),
    "gold out of range": ('\n{"context": "a", "choices": ["x", "y"], "gold": 2}\n', 2, "from 0 to 1"),
    "gold a boolean": ('{"context": "a", "choices": ["x", "y"], "gold": true}\n', 1, "\"gold\" is True"),
    "not JSON": ('{"context": "a", "choices": ["x", "y"], "gold": 0}\n{"context": \n', 2, "is not JSON"),
    "blank context": ('{"context": "  ", "choices": ["x", "y"], "gold": 0}\n', 1, "\"context\" must be"),
    "empty choice": ('{"context": "a", "choices": ["x", ""], "gold": 0}\n', 1, "choice 1 is ''"),
}


@pytest.mark.parametrize("case", BAD_FILES)
def test_a_bad_task_file_is_refused_naming_the_file_and_line(tmp_path, case):
    text, line, reason = BAD_FILES[case]
    path = tmp_path / "bad.jsonl"
    path.write_text(text)
    with pytest.raises(UserError) as err:
        load_task_file(path)
    assert f"{path}, line {line}" in str(err.value) and reason in str(err.value)
    assert err.value.exit_code == 2


def test_an_empty_or_missing_task_file_is_refused(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n \n")
    with pytest.raises(UserError, match="empty.jsonl holds no items"):
        load_task_file(tmp_path / "empty.jsonl")
    with pytest.raises(UserError, match="missing.jsonl does not exist"):
        load_task_file(tmp_path / "missing.jsonl")


def test_a_task_file_round_trips(tmp_path):
    task = Task("handmade", tuple(HANDMADE))
    assert load_task_file(write_task_file(task, tmp_path / "handmade.jsonl")) == task


def test_eval_every_steps_must_fall_on_validations():
    cfg = load_config("recipes/tiny.yaml", ["eval.tasks=[next_line]", "eval.every_steps=200"])
    assert cfg.eval.due(200, 100, 300) and not cfg.eval.due(100, 100, 300) and cfg.eval.due(300, 100, 300)
    with pytest.raises(UserError, match="eval.every_steps=150 must be a multiple of train.eval_every_steps=100"):
        load_config("recipes/tiny.yaml", ["eval.tasks=[next_line]", "eval.every_steps=150"])


def test_the_report_sets_task_accuracy_against_chance():
    rows = [{"step": 10, "loss": 3.0}, {"step": 10, "val_loss": 3.0, "acc/nl": 0.3, "acc_norm/nl": 0.25, "chance/nl": 0.25},
            {"step": 20, "val_loss": 2.0, "acc/nl": 0.5, "acc_norm/nl": 0.45, "chance/nl": 0.25}]
    table = "\n".join(task_table(rows))
    assert "| nl | 0.2500 | 0.3000 (10) | 0.5000 (20) | 0.5000 | 0.4500 | 0.4500 |" in table
    assert task_table([{"step": 1, "val_loss": 2.0}]) == []
