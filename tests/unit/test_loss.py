"""The chunked loss against the full-logits path: loss and gradients, any chunk size, tied weights, document masking,
bf16, validation, generation, no host sync; the automatic choice and the memory estimate's terms."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

from lmrecipe.config import AUTO_LOSS_CHUNK_MIN_VOCAB, AUTO_LOSS_CHUNK_TOKENS, TrainConfig
from lmrecipe.errors import UserError
from lmrecipe.model.loss import ChunkedLossHead, causal_lm_loss, chunked_head, use_chunked_loss
from lmrecipe.planning.memory import ModelShape, output_layer_bytes
from lmrecipe.observe.host_syncs import HostSyncCounter

VOCAB = 1000


def llama(tie: bool = False, dtype=torch.float32):
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, tie_word_embeddings=tie)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)


def gpt2():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0),
                                            attn_implementation="sdpa")


def batch(rows: int = 3, seq: int = 33):
    generator = torch.Generator().manual_seed(1)
    return (torch.randint(0, VOCAB, (rows, seq), generator=generator),
            torch.randint(0, VOCAB, (rows, seq), generator=generator))


def loss_and_grads(model, inputs, targets, **kwargs):
    model.zero_grad(set_to_none=True)
    loss = causal_lm_loss(model, inputs, targets, model_kwargs=kwargs or None)
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """Norm-wise relative difference ||a - b|| / ||b||."""
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("make", [llama, lambda: llama(tie=True), gpt2], ids=["llama", "llama-tied", "gpt2"])
@pytest.mark.parametrize("chunk", [7, 64, 10_000])
def test_chunked_loss_and_gradients_equal_the_full_logits_path(make, chunk):
    full = make()
    chunked = copy.deepcopy(full)
    use_chunked_loss(chunked, chunk)
    inputs, targets = batch()
    want_loss, want = loss_and_grads(full, inputs, targets)
    got_loss, got = loss_and_grads(chunked, inputs, targets)
    assert got.keys() == want.keys() and dict(chunked.state_dict()).keys() == dict(full.state_dict()).keys()
    assert relative(got_loss, want_loss) <= 1e-6
    assert max(relative(got[name], want[name]) for name in want) <= 1e-6


def test_ties_survive_and_the_head_holds_the_same_parameter():
    model = llama(tie=True)
    embedding = model.get_input_embeddings().weight
    use_chunked_loss(model, 16)
    head = model.get_output_embeddings()
    assert isinstance(head, ChunkedLossHead) and head.weight is embedding
    assert chunked_head(torch.nn.parallel.DistributedDataParallel.__new__(torch.nn.Module)) is None
    wrapper = torch.nn.Module()
    wrapper.module = model  # how DDP and DeepSpeed hold the model
    assert chunked_head(wrapper) is head


def test_per_token_losses_with_document_keywords_equal_the_full_path():
    """The reduction="none" path of validation, with position ids restarting inside the rows."""
    full = llama()
    chunked = copy.deepcopy(full)
    use_chunked_loss(chunked, 10)
    inputs, targets = batch(rows=2, seq=20)
    positions = torch.cat([torch.arange(8), torch.arange(12)]).expand(2, -1)
    with torch.no_grad():
        want = causal_lm_loss(full, inputs, targets, "none", {"position_ids": positions})
        got = causal_lm_loss(chunked, inputs, targets, "none", {"position_ids": positions})
    assert got.shape == targets.shape and relative(got, want) <= 1e-6


def test_bf16_follows_the_full_path_within_bf16_rounding():
    full = llama(dtype=torch.bfloat16)
    chunked = copy.deepcopy(full)
    use_chunked_loss(chunked, 16)
    inputs, targets = batch()
    want_loss, want = loss_and_grads(full, inputs, targets)
    got_loss, got = loss_and_grads(chunked, inputs, targets)
    assert got_loss.dtype == torch.float32 and relative(got_loss, want_loss) <= 1e-3
    assert max(relative(got[name], want[name]) for name in want) <= 2e-2  # bf16 gradients: 8 mantissa bits


def test_without_targets_the_head_returns_logits_so_generation_works():
    full = llama()
    chunked = copy.deepcopy(full)
    use_chunked_loss(chunked, 8)
    inputs, _ = batch(rows=1, seq=5)
    with torch.no_grad():
        assert torch.equal(chunked(input_ids=inputs).logits, full(input_ids=inputs).logits)
        assert torch.equal(chunked.generate(inputs, max_new_tokens=3, do_sample=False),
                           full.generate(inputs, max_new_tokens=3, do_sample=False))


def test_the_chunked_forward_and_backward_make_no_host_sync():
    model = llama()
    use_chunked_loss(model, 16)
    inputs, targets = batch()
    with HostSyncCounter() as counter:
        causal_lm_loss(model, inputs, targets).backward()
    assert counter.total == 0, counter.sources


def test_an_output_layer_that_is_not_a_linear_is_refused():
    model = llama()
    model.lm_head = torch.nn.Sequential(model.lm_head)
    with pytest.raises(UserError, match="train.loss_chunk_tokens=0"):
        use_chunked_loss(model, 16)


def test_auto_turns_the_chunked_loss_on_for_large_vocabularies_only():
    auto = TrainConfig()
    assert auto.chunk_tokens(128_256) == AUTO_LOSS_CHUNK_TOKENS and auto.chunk_tokens(AUTO_LOSS_CHUNK_MIN_VOCAB) > 0
    assert auto.chunk_tokens(32_000) == 0 and auto.chunk_tokens(50_257) == 0
    assert TrainConfig(loss_chunk_tokens=0).chunk_tokens(128_256) == 0
    assert TrainConfig(loss_chunk_tokens=512).chunk_tokens(384) == 512


def test_the_estimate_counts_one_chunk_of_logits_instead_of_all():
    shape = ModelShape(n_params=0, largest_layer_params=0, param_sizes=(), num_layers=1, hidden_size=4096,
                       kv_size=1024, mlp_size=14336, num_heads=32, vocab_size=128_256)
    tokens = 2 * 8192
    full = output_layer_bytes(shape, tokens, "bf16")
    chunked = output_layer_bytes(shape, tokens, "bf16", loss_chunk_tokens=1024)
    assert full == tokens * (2 * 4096 * 2 + 128_256 * (2 + 8)) + 2 * 128_256 * 4096
    assert chunked == tokens * (2 * 4096 * 2 + 4) + 1024 * 128_256 * (4 + 2) + 4 * 128_256 * 4096
    assert chunked < full / 2
