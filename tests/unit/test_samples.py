"""In-loop generation samples (``eval.samples``): greedy continuations at every evaluation, as ``generate`` gives them,
in ``metrics.jsonl`` and the run report."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import TINY_OVERRIDES

from lmrecipe.model.attention import build_document_attention
from lmrecipe.config import load_config
from lmrecipe.errors import UserError
from lmrecipe.evaluation.evaluate import greedy_continuation


def random_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         max_position_embeddings=64, initializer_range=0.5, attn_implementation="sdpa")
    return LlamaForCausalLM(config).eval()


def generate(model, prompt: list[int], new_tokens: int, eos_id: int | None) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens,
                         eos_token_id=eos_id, pad_token_id=0)[0, len(prompt):].tolist()
    return out[:out.index(eos_id)] if eos_id in out else out


def test_greedy_continuation_is_what_generate_gives_with_and_without_document_masking():
    model = random_model()
    prompts = [[5, 9, 2], [17], [40, 41, 42, 43, 44, 45]]
    expected = [generate(model, p, 10, None) for p in prompts]
    assert len({tuple(e) for e in expected}) == 3 and all(len(set(e)) > 1 for e in expected)  # not a constant
    assert [greedy_continuation(model, p, 10, None, "cpu") for p in prompts] == expected
    eos = expected[0][4]  # a token of the first continuation ends it there, as in generate
    cut = greedy_continuation(model, prompts[0], 10, eos, "cpu")
    assert cut == generate(model, prompts[0], 10, eos) == expected[0][:expected[0].index(eos)]
    attention = build_document_attention("sdpa", model.config)
    model.set_attn_implementation(attention.name)
    assert [greedy_continuation(model, p, 10, None, "cpu", attention) for p in prompts] == expected
    assert not model.training


def train_tiny(out, tiny_data, *overrides: str):
    from lmrecipe.train.trainer import train

    train(load_config("recipes/tiny.yaml", [
        f"out_dir={out}", f"data.path={tiny_data}", *TINY_OVERRIDES, "train.max_steps=6", "train.eval_every_steps=3",
        "checkpoint.every_steps=0", "checkpoint.resume=none", *overrides]))


def test_samples_at_every_evaluation_match_generate_on_the_exported_weights(tmp_path, tiny_data):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompts = ["def main(", "import os\n"]
    train_tiny(tmp_path, tiny_data, f"eval.samples={json.dumps(prompts)}", "eval.sample_tokens=8",
               "checkpoint.export_at_end=true", "checkpoint.export_dtype=fp32")
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    sampled = [r for r in rows if "samples" in r]
    assert [r["step"] for r in sampled] == [3, 6] and [r["step"] for r in rows if "val_loss" in r] == [3, 6]
    assert [s["prompt"] for s in sampled[-1]["samples"]] == prompts
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "export")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    for sample in sampled[-1]["samples"]:
        prompt = tokenizer(sample["prompt"], add_special_tokens=False).input_ids
        expected = generate(model, prompt, 8, tokenizer.eos_token_id)
        assert sample["text"] == tokenizer.decode(expected, skip_special_tokens=True)
    report = (tmp_path / "report.md").read_text()
    assert "## Samples (greedy, step 6)" in report and "- `import os\\n` -> `" in report


def test_prompts_that_cannot_be_continued_are_refused_before_training(tmp_path, tiny_data):
    with pytest.raises(UserError, match=r"eval.samples\[0\]='' is not a prompt"):
        load_config("recipes/tiny.yaml", ['eval.samples=[""]'])
    with pytest.raises(UserError, match=r"eval.sample_tokens=40: the model holds 32 positions"):
        train_tiny(tmp_path, tiny_data, 'eval.samples=["def "]', "eval.sample_tokens=40")
    assert not (tmp_path / "metrics.jsonl").exists()
