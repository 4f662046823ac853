"""Linear attention under document masking: Qwen3.5-MoE's gated DeltaNet layers run per document, so a packed batch
equals its documents run alone (forward and every parameter's gradient), and recurrent layers that cannot run per
document are refused at start-up."""

from __future__ import annotations

import copy
from itertools import pairwise

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import ROOT, write_data
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.models.minimax.configuration_minimax import MiniMaxConfig
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig

from lmrecipe.config import ModelConfig, TrainConfig, load_config
from lmrecipe.data.documents import document_batch
from lmrecipe.errors import UserError
from lmrecipe.model import linear_attention
from lmrecipe.model.attention import build_document_attention
from lmrecipe.model.build import build_model
from lmrecipe.model.linear_attention import (KEYWORD, PerDocumentLinearAttention, check_linear_attention,
                                             install_per_document, segment_plan)
from lmrecipe.observe.host_syncs import HostSyncCounter
from lmrecipe.train.preflight import preflight

SEQ_LEN = 24
ROWS = [[5, 12, 7], [9, 2, 13]]
"""Document lengths of each row of the packed batch: three documents of different lengths per row."""
VOCAB = 61


def tiny_qwen3_5_moe() -> Qwen3_5MoeTextConfig:
    """Four layers: three gated DeltaNet (convolution kernel 4) and one gated full attention; 4 experts, top 2."""
    return Qwen3_5MoeTextConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
        moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=64, use_cache=False)


def packed_batch():
    """Inputs and targets ``[2, SEQ_LEN]`` of the documents of ROWS laid end to end, and their DocumentBatch."""
    lengths = [n for row in ROWS for n in row]
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype("<u8")
    stream = torch.from_numpy(np.random.default_rng(0).integers(0, VOCAB, size=len(ROWS) * SEQ_LEN + 1))
    rows = torch.stack([stream[r * SEQ_LEN : (r + 1) * SEQ_LEN + 1] for r in range(len(ROWS))])
    offsets = np.arange(len(ROWS)) * SEQ_LEN
    return rows[:, :-1], rows[:, 1:], document_batch(starts, offsets, SEQ_LEN)


def stock_model(config, implementation: str = "sdpa"):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=implementation,
                                             dtype=torch.float32)
    model.config.use_cache = False
    return model


def grads(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def packed_run(model, attention, inputs, targets, batch):
    model.zero_grad()
    logits = model(input_ids=inputs, **attention.forward_kwargs(batch, "cpu")).logits
    F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum").backward()
    return logits.detach().flatten(0, 1), grads(model)


def documents_alone(model, inputs, targets, batch):
    """Each document as its own sequence through the stock model (positions from 0, fresh states)."""
    model.zero_grad()
    pieces = []
    for first, stop in pairwise(batch.cu_seqlens.tolist()):
        logits = model(input_ids=inputs.flatten()[None, first:stop]).logits[0]
        F.cross_entropy(logits, targets.flatten()[first:stop], reduction="sum").backward()
        pieces.append(logits.detach())
    return torch.cat(pieces), grads(model)


def largest_differences(run, reference) -> tuple[float, float]:
    (logits, grads_run), (ref_logits, ref_grads) = run, reference
    assert grads_run.keys() == ref_grads.keys()
    return ((logits - ref_logits).abs().max().item(),
            max((grads_run[n] - ref_grads[n]).abs().max().item() for n in ref_grads))


EQUIVALENCE_CASES = {  # (model.attn_implementation, MIN_GROUP_LEN, activation checkpointing)
    "sdpa-one-group": ("sdpa", 64, False),
    "sdpa-groups-by-length-checkpointed": ("sdpa", 4, True),
    "eager-groups-by-length": ("eager", 4, False),
}


@pytest.mark.parametrize("case", EQUIVALENCE_CASES)
def test_packed_batch_equals_its_documents_run_alone(case, monkeypatch):
    requested, min_group_len, checkpointing = EQUIVALENCE_CASES[case]
    monkeypatch.setattr(linear_attention, "MIN_GROUP_LEN", min_group_len)
    config = tiny_qwen3_5_moe()
    inputs, targets, batch = packed_batch()
    assert batch.n_segments == 6 and len({n for row in ROWS for n in row}) == 6
    attention = build_document_attention(requested, config)
    assert attention.linear_attention
    reference_model = stock_model(config)
    model = stock_model(config, attention.name)
    assert install_per_document(model) == 3
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    logits_diff, grad_diff = largest_differences(packed_run(model, attention, inputs, targets, batch),
                                                 documents_alone(reference_model, inputs, targets, batch))
    assert logits_diff < 1e-5 and grad_diff < 1e-5, (logits_diff, grad_diff)


def test_without_the_per_document_layers_documents_leak():
    """The same comparison fails when only attention is masked: the DeltaNet layers carry one document into the
    next (the test above could fail)."""
    config = tiny_qwen3_5_moe()
    inputs, targets, batch = packed_batch()
    attention = build_document_attention("sdpa", config)
    model = stock_model(config, attention.name)
    kwargs = attention.forward_kwargs(batch, "cpu")
    del kwargs[KEYWORD]
    model.zero_grad()
    logits = model(input_ids=inputs, **kwargs).logits
    F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum").backward()
    leaked = logits.detach().flatten(0, 1), grads(model)
    logits_diff, grad_diff = largest_differences(leaked, documents_alone(stock_model(config), inputs, targets, batch))
    assert logits_diff > 1e-3 and grad_diff > 1e-3, (logits_diff, grad_diff)


def test_the_recipe_builds_the_per_document_layers_with_the_stock_names():
    config = tiny_qwen3_5_moe()
    attention = build_document_attention("sdpa", config)
    model = build_model(ModelConfig(), TrainConfig(), config, attention)
    layers = [layer.linear_attn for layer in model.model.layers if hasattr(layer, "linear_attn")]
    assert len(layers) == 3 and all(isinstance(m, PerDocumentLinearAttention) for m in layers)
    assert list(model.state_dict()) == list(stock_model(config).state_dict())
    assert copy.deepcopy(model).model.layers[0].linear_attn.__class__ is layers[0].__class__
    plain = build_model(ModelConfig(), TrainConfig(), config, None)
    assert not any(isinstance(m, PerDocumentLinearAttention) for m in plain.modules())


def test_per_document_forward_and_backward_make_no_host_sync(monkeypatch):
    monkeypatch.setattr(linear_attention, "MIN_GROUP_LEN", 4)  # several groups
    config = tiny_qwen3_5_moe()
    inputs, targets, batch = packed_batch()
    attention = build_document_attention("sdpa", config)
    model = stock_model(config, attention.name)
    install_per_document(model)
    kwargs = attention.forward_kwargs(batch.as_tensors(), "cpu")  # host work, before the forward
    assert len(kwargs[KEYWORD].groups) > 1
    with HostSyncCounter() as counter:
        logits = model(input_ids=inputs, **kwargs).logits
        F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    assert counter.calls == {}, counter.sources


def test_a_forward_without_the_segments_fails_loudly():
    config = tiny_qwen3_5_moe()
    inputs, _, batch = packed_batch()
    attention = build_document_attention("sdpa", config)
    model = stock_model(config, attention.name)
    install_per_document(model)
    kwargs = attention.forward_kwargs(batch, "cpu")
    del kwargs[KEYWORD]
    with pytest.raises(ValueError, match=KEYWORD):
        model(input_ids=inputs, **kwargs)


def test_one_document_per_row_runs_the_rows_as_they_are():
    config = tiny_qwen3_5_moe()
    inputs, targets, _ = packed_batch()
    whole = document_batch(np.array([0, SEQ_LEN, 2 * SEQ_LEN + 1], dtype="<u8"), [0, SEQ_LEN], SEQ_LEN)
    attention = build_document_attention("sdpa", config)
    assert attention.forward_kwargs(whole, "cpu")[KEYWORD].groups == ()
    model = stock_model(config, attention.name)
    install_per_document(model)
    logits = model(input_ids=inputs, **attention.forward_kwargs(whole, "cpu")).logits
    reference = stock_model(config)(input_ids=inputs).logits
    assert (logits - reference).abs().max().item() < 1e-5


def test_segment_plan_places_every_token_once():
    cu = np.array([0, 3, 4, 12, 16, 30, 32])
    groups, inverse = segment_plan(cu, min_group_len=4)
    assert [g.shape for g in groups] == [(4, 4), (1, 8), (1, 14)]  # lengths 3, 1, 4, 2 | 8 | 14
    assert groups[0].tolist() == [[0, 1, 2, 2], [3, 3, 3, 3], [12, 13, 14, 15], [30, 31, 31, 31]]  # last token repeated
    laid = np.concatenate([g.reshape(-1) for g in groups])
    assert laid[inverse].tolist() == list(range(32))


def test_models_without_recurrent_layers_are_untouched():
    config = LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, vocab_size=VOCAB)
    assert not check_linear_attention(config)
    assert not build_document_attention("sdpa", config).linear_attention


def test_recurrent_layers_that_cannot_run_per_document_are_refused():
    config = MiniMaxConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           intermediate_size=32, vocab_size=VOCAB, layer_types=["linear_attention", "full_attention"])
    with pytest.raises(UserError) as caught:
        build_document_attention("sdpa", config)
    message = " ".join(str(caught.value).split())
    assert "data.document_masking=false" in message and "model.arch=minimax" in message
    assert "layers 0" in message and "qwen3_5_moe_text" in message


QWEN3_5_MOE_EXTRA = ("model.linear_key_head_dim=32", "model.linear_value_head_dim=32", "model.linear_key_heads=2",
                     "model.linear_value_heads=4", "model.num_experts=4", "model.experts_per_token=2",
                     "model.expert_intermediate_size=64", "model.shared_experts=1")
MINIMAX_EXTRA = ("model.extra={layer_types: [linear_attention, full_attention, linear_attention, full_attention]}",)


@pytest.mark.parametrize(("arch", "extra", "masking", "refused"), [
    ("qwen3_5_moe_text", QWEN3_5_MOE_EXTRA, "true", False),
    ("minimax", MINIMAX_EXTRA, "true", True),
    ("minimax", MINIMAX_EXTRA, "false", False),
], ids=["qwen3_5_moe_text-split", "minimax-refused", "minimax-without-masking"])
def test_the_start_up_checks_refuse_only_what_cannot_run_per_document(tmp_path, arch, extra, masking, refused):
    data = write_data(tmp_path / "data", vocab=384)
    cfg = load_config(str(ROOT / "recipes" / "tiny.yaml"),
                      [f"out_dir={tmp_path / 'run'}", f"data.path={data}", f"model.arch={arch}", *extra,
                       f"data.document_masking={masking}"])
    found = preflight(cfg, dry=True)
    if refused:
        assert len(found.problems) == 1 and "data.document_masking=false" in found.problems[0], found.problems
    else:
        assert found.problems == []
        assert (found.attention is not None and found.attention.linear_attention) == (masking == "true")


def test_evaluation_masks_with_the_per_document_layers_and_generates_with_the_stock_ones():
    from lmrecipe.evaluation.evaluate import masking_attention
    from lmrecipe.model.linear_attention import remove_per_document

    config = tiny_qwen3_5_moe()
    inputs, targets, batch = packed_batch()
    model = stock_model(config)
    model.config.use_cache = True  # as an export's config has it
    stock_class = type(model.model.layers[0].linear_attn)
    attention = masking_attention(model)
    assert attention.linear_attention and isinstance(model.model.layers[0].linear_attn, PerDocumentLinearAttention)
    with torch.no_grad():
        logits = model(input_ids=inputs, **attention.forward_kwargs(batch, "cpu")).logits.flatten(0, 1)
    reference, _ = documents_alone(stock_model(config), inputs, targets, batch)
    assert (logits - reference).abs().max().item() < 1e-5
    remove_per_document(model)
    assert type(model.model.layers[0].linear_attn) is stock_class
