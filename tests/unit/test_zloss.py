"""The z-loss (``train.z_loss``): its value, the chunked path against the full one, off means untouched, and the
language-model loss alone in validation, perplexity and ``eval.py``."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from helpers import TINY_OVERRIDES
from transformers import AutoModelForCausalLM, LlamaConfig

from lmrecipe.config import load_config
from lmrecipe.errors import UserError
from lmrecipe.model.loss import IGNORE_INDEX, causal_lm_loss, training_loss, use_chunked_loss
from lmrecipe.observe.host_syncs import HostSyncCounter

VOCAB = 1000
COEF = 1e-2


def llama(tie: bool = False):
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, tie_word_embeddings=tie)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    with torch.no_grad():  # logits far from 0, so the z-loss is a sizeable share of the gradient
        model.get_output_embeddings().weight.mul_(8)
    return model


def batch(rows: int = 3, seq: int = 33):
    generator = torch.Generator().manual_seed(1)
    return (torch.randint(0, VOCAB, (rows, seq), generator=generator),
            torch.randint(0, VOCAB, (rows, seq), generator=generator))


def terms_and_grads(model, inputs, targets, coef):
    model.zero_grad(set_to_none=True)
    terms = training_loss(model, inputs, targets, coef)
    terms.objective().backward()
    return terms.lm.detach(), terms.z, {name: p.grad.clone() for name, p in model.named_parameters()}


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def test_the_z_loss_is_the_mean_squared_log_partition_of_the_counted_tokens():
    model = llama()
    inputs, targets = batch()
    targets[0, :5] = IGNORE_INDEX  # tokens the language-model loss skips are skipped here too
    with torch.no_grad():
        lm_loss, z_term = training_loss(model, inputs, targets, COEF)[:2]
        logits = model(input_ids=inputs).logits.float()
    counted = targets != IGNORE_INDEX
    want = COEF * torch.logsumexp(logits, -1)[counted].square().mean()
    assert relative(z_term, want) <= 1e-6 and z_term > 1e-3
    assert torch.equal(lm_loss, torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()))


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("chunk", [7, 10_000])
def test_the_chunked_path_gives_the_full_paths_z_loss_and_gradients(tie, chunk):
    full = llama(tie)
    chunked = copy.deepcopy(full)
    use_chunked_loss(chunked, chunk)
    inputs, targets = batch()
    want_loss, want_z, want = terms_and_grads(full, inputs, targets, COEF)
    got_loss, got_z, got = terms_and_grads(chunked, inputs, targets, COEF)
    assert relative(got_loss, want_loss) <= 1e-6 and relative(got_z, want_z) <= 1e-6
    assert max(relative(got[name], want[name]) for name in want) <= 1e-6
    _, _, without = terms_and_grads(full, inputs, targets, 0.0)  # the z-loss moves the gradients: the test can fail
    head = "model.embed_tokens.weight" if tie else "lm_head.weight"
    assert relative(without[head], want[head]) > 1e-3


@pytest.mark.parametrize("chunk", [0, 7])
def test_off_leaves_the_loss_and_gradients_of_the_language_model_loss(chunk):
    """Full logits: bit-identical to the loss alone. Chunked: the training head (gradients formed in its forward)
    against the per-token path's loss and backward, to fp32 rounding."""
    a = llama()
    b = copy.deepcopy(a)
    if chunk:
        use_chunked_loss(a, chunk)
        use_chunked_loss(b, chunk)
    inputs, targets = batch()
    a.zero_grad(set_to_none=True)
    want = causal_lm_loss(a, inputs, targets)
    want.backward()
    got, z_term, grads = terms_and_grads(b, inputs, targets, 0.0)
    assert z_term is None
    if chunk:
        assert relative(got, want.detach()) <= 1e-6
        assert max(relative(grads[name], p.grad) for name, p in a.named_parameters()) <= 1e-6
    else:
        assert torch.equal(got, want.detach())
        assert all(torch.equal(grads[name], p.grad) for name, p in a.named_parameters())


def test_the_chunked_z_loss_makes_no_host_sync():
    model = llama()
    use_chunked_loss(model, 16)
    inputs, targets = batch()
    with HostSyncCounter() as counter:
        training_loss(model, inputs, targets, COEF).objective().backward()
    assert counter.total == 0, counter.sources


def test_a_negative_coefficient_is_refused():
    with pytest.raises(UserError, match="train.z_loss"):
        load_config("recipes/tiny.yaml", ["train.z_loss=-1e-4"])


def test_validation_and_eval_report_the_language_model_loss_alone(tmp_path, tiny_data):
    """A run with a large z-loss logs it apart from ``loss``; its validation loss (and perplexity) and ``eval.py``'s
    loss on its export are the export's language-model loss, without the z-loss."""
    from lmrecipe.evaluation.evaluate import evaluate_path
    from lmrecipe.train.trainer import train

    out = tmp_path / "run"
    train(load_config("recipes/tiny.yaml", [
        f"out_dir={out}", f"data.path={tiny_data}", *TINY_OVERRIDES, "train.max_steps=1", "train.z_loss=0.5",
        "train.eval_every_steps=0", "checkpoint.every_steps=0", "checkpoint.resume=none",
        "checkpoint.export_at_end=true", "checkpoint.export_dtype=fp32"]))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "loss" in r]
    val = [r for r in rows if "val_loss" in r][-1]
    assert all(r["z_loss"] > 0.01 for r in train_rows)  # logged apart, and large enough to show in a sum
    assert val["val_ppl"] == pytest.approx(math.exp(val["val_loss"]), rel=1e-9)
    result, _ = evaluate_path(out / "export", tiny_data, max_batches=2, batch_size=8, seq_len=32)  # the 16 windows
    assert result["loss"] == pytest.approx(val["val_loss"], rel=1e-5)
    assert abs(result["loss"] - val["val_loss"]) < 1e-3 * train_rows[-1]["z_loss"]
