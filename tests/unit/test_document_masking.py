"""Document masking: boundaries from the index, per-document equivalence of loss and gradients, no host syncs,
and clear refusals for the attention paths that cannot mask."""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from transformers import AutoModelForCausalLM, FalconConfig, GPT2Config, LlamaConfig, MistralConfig, MptConfig
from transformers import modeling_flash_attention_utils as flash_utils
from transformers.utils import is_flash_attn_2_available, is_kernels_available

from lmrecipe.model.attention import DOCUMENT_SDPA, build_document_attention
from lmrecipe.data.documents import document_batch
from lmrecipe.errors import UserError

EOS = 96
SEQ_LEN = 16
# Document lengths of the token stream (each ends with EOS): short, long (> SEQ_LEN), a lone EOS, ...
DOC_LENGTHS = [7, 3, 20, 1, 5, 9, 2, 6, 11, 4, 8]
# Row 0 starts mid-document; row 1 starts exactly on a document start (offset 36 = 7+3+20+1+5).
OFFSETS = [4, 36]

# A document index: starts 0, 5, 8, 20, 21 and the split's end 30.
STARTS = [0, 5, 8, 20, 21, 30]
HAND_CASES = {  # offset: (position_ids, document_ids) of one window of 4 tokens
    "starts-at-window-start": (5, [0, 1, 2, 0], [0, 0, 0, 1]),
    "document-starts-at-last-token": (17, [0, 1, 2, 0], [0, 0, 0, 1]),
    "eos-of-previous-document-first": (4, [0, 0, 1, 2], [0, 1, 1, 1]),
    "one-document-longer-than-window": (9, [0, 1, 2, 3], [0, 0, 0, 0]),
    "several-documents": (19, [0, 0, 0, 1], [0, 1, 2, 2]),
}


def tiny_llama_config() -> LlamaConfig:
    """Grouped-query attention (2 key/value heads for 4 query heads) and rotary positions."""
    return LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=128, vocab_size=97, max_position_embeddings=128)


def tiny_gpt2_config() -> GPT2Config:
    """Learned absolute positions: rotary ones are blind to a position offset shared by a whole document, these
    are not, so this model also checks that positions restart at each document."""
    return GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=97, n_positions=128, resid_pdrop=0.0,
                      embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=EOS, eos_token_id=EOS)


def tiny_mistral_config() -> MistralConfig:
    """A sliding window (4 tokens) shorter than most documents."""
    return MistralConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=97, max_position_embeddings=128, sliding_window=4)


CONFIGS = {"llama": tiny_llama_config, "gpt2": tiny_gpt2_config, "mistral-sliding-window": tiny_mistral_config}


class HostSyncCounter(TorchFunctionMode):
    """Counts the tensor calls that copy a value to the host (each one stalls a GPU until its queue drains)."""

    NAMES = frozenset({"item", "tolist", "numpy", "__bool__", "__float__", "__int__", "__index__"})

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in self.NAMES:
            self.calls.append(func.__name__)
        return func(*args, **(kwargs or {}))


def packed_stream() -> tuple[np.ndarray, np.ndarray]:
    """Random tokens in documents of DOC_LENGTHS, each ending with EOS, and their index (starts, then the end)."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, EOS, size=sum(DOC_LENGTHS))
    starts = np.concatenate([[0], np.cumsum(DOC_LENGTHS)])
    tokens[starts[1:] - 1] = EOS
    return tokens, starts.astype("<u8")


def packed_batch():
    tokens, starts = packed_stream()
    rows = np.stack([tokens[o : o + SEQ_LEN + 1] for o in OFFSETS])
    inputs, targets = torch.from_numpy(rows[:, :-1]), torch.from_numpy(rows[:, 1:])
    return inputs, targets, document_batch(starts, OFFSETS, SEQ_LEN)


def fake_flash_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                      softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, deterministic=False):
    """flash_attn_varlen_func's contract in plain torch ([tokens, heads, dim], causal within each cu_seqlens
    segment, fewer key/value heads shared by query groups), with no host read."""
    assert causal and isinstance(max_seqlen_q, int) and cu_seqlens_q.dtype == torch.int32
    n_tokens = q.shape[0]
    segment = torch.searchsorted(cu_seqlens_q[1:], torch.arange(n_tokens, dtype=torch.int32), right=True)
    allowed = (segment[:, None] == segment[None, :]) & torch.ones(n_tokens, n_tokens, dtype=torch.bool).tril()
    group = q.shape[1] // k.shape[1]
    q, k, v = (x.transpose(0, 1)[None] for x in (q, k, v))
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=softmax_scale)
    return out[0].transpose(0, 1)


@pytest.fixture
def fake_flash_kernel(monkeypatch):
    """transformers' flash path on CPU: its kernel loader hands out :func:`fake_flash_varlen`, when asked for a
    real kernel name (our registered names must never reach the loader)."""
    process = flash_utils._lazy_define_process_function(fake_flash_varlen)

    def load(implementation, *args, **kwargs):
        assert implementation in ("flash_attention_2", "flash_attention_3")  # the real name, never ours
        return (None, fake_flash_varlen, None, None, None), (process, dict)

    monkeypatch.setattr(flash_utils, "lazy_import_flash_attention", load)


def build(config, attn_implementation: str, state_dict=None):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation, dtype=torch.float32)
    if state_dict is not None:
        model.load_state_dict(state_dict)
    model.config.use_cache = False
    return model


def loss_and_grads(model, loss) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad()
    loss.backward()
    return loss.item(), {name: p.grad.clone() for name, p in model.named_parameters()}


def masked_run(config, requested: str):
    inputs, targets, batch = packed_batch()
    attention = build_document_attention(requested, config)
    model = build(config, attention.name)
    logits = model(input_ids=inputs, use_cache=False, **attention.forward_kwargs(batch, "cpu")).logits
    return model, loss_and_grads(model, F.cross_entropy(logits.flatten(0, 1), targets.flatten()))


def per_document_run(config, state_dict):
    """Each segment of the packed batch as its own sequence (positions from 0, plain causal, stock eager)."""
    inputs, targets, batch = packed_batch()
    model = build(config, "eager", state_dict)
    cuts = batch.cu_seqlens.tolist()
    total = 0.0
    for first, stop in pairwise(cuts):
        logits = model(input_ids=inputs.flatten()[None, first:stop], use_cache=False).logits[0]
        total = total + F.cross_entropy(logits, targets.flatten()[first:stop], reduction="sum")
    return loss_and_grads(model, total / targets.numel())


def differences(run, reference) -> tuple[float, float]:
    (loss, grads), (ref_loss, ref_grads) = run, reference
    scale = max(g.abs().max().item() for g in ref_grads.values())
    grad_diff = max((grads[n] - ref_grads[n]).abs().max().item() for n in ref_grads)
    return abs(loss - ref_loss) / abs(ref_loss), grad_diff / scale


@pytest.mark.parametrize("case", HAND_CASES, ids=str)
@pytest.mark.parametrize("index_dtype", ["<u8", "<i8"])
def test_document_batch_matches_hand_computed_boundaries(case, index_dtype):
    offset, positions, documents = HAND_CASES[case]
    batch = document_batch(np.array(STARTS, dtype=index_dtype), [offset], 4)
    assert batch.position_ids.tolist() == [positions] and batch.position_ids.dtype == np.int64
    assert batch.document_ids.tolist() == [documents] and batch.document_ids.dtype == np.int32
    lengths = np.bincount(documents)
    assert batch.cu_seqlens.tolist() == [0, *np.cumsum(lengths)] and batch.cu_seqlens.dtype == np.int32
    assert batch.max_seqlen == lengths.max() and isinstance(batch.max_seqlen, int)


def test_document_batch_flattens_rows_in_order_from_a_memmapped_index(tmp_path):
    path = tmp_path / "train.idx"
    np.array(STARTS, dtype="<u8").tofile(path)
    offsets = [HAND_CASES[case][0] for case in HAND_CASES]
    batch = document_batch(np.memmap(path, dtype="<u8", mode="r"), offsets, 4)
    assert batch.position_ids.tolist() == [HAND_CASES[case][1] for case in HAND_CASES]
    # segments per row: 3+1 | 3+1 | 1+3 | 4 | 1+1+2, laid end to end
    assert batch.cu_seqlens.tolist() == [0, 3, 4, 7, 8, 9, 12, 16, 17, 18, 20]
    assert batch.n_segments == 10 and batch.max_seqlen == 4


@pytest.mark.parametrize("offsets", [[-1], [27], [[0, 4]]], ids=["negative", "past-the-end", "not-1d"])
def test_document_batch_rejects_windows_outside_the_split(offsets):
    with pytest.raises(ValueError, match="offset"):
        document_batch(np.array(STARTS, dtype="<u8"), offsets, 4)


EQUIVALENCE_CASES = [("llama", "sdpa"), ("llama", "eager"), ("llama", "flash_attention_2"), ("llama", "flash_attention_3"),
                     ("llama", "varlen"), ("gpt2", "sdpa"), ("gpt2", "eager"), ("gpt2", "varlen"),
                     ("mistral-sliding-window", "sdpa")]


@pytest.mark.parametrize(("arch", "requested"), EQUIVALENCE_CASES, ids=[f"{a}-{r}" for a, r in EQUIVALENCE_CASES])
def test_masked_packed_batch_equals_its_documents_run_alone(arch, requested, request):
    if requested.startswith("flash"):
        request.getfixturevalue("fake_flash_kernel")
    config = CONFIGS[arch]()
    _, starts = packed_stream()
    assert document_batch(starts, OFFSETS, SEQ_LEN).n_segments >= 6
    model, masked = masked_run(config, requested)
    loss_diff, grad_diff = differences(masked, per_document_run(config, model.state_dict()))
    assert loss_diff < 1e-6 and grad_diff < 1e-6, (loss_diff, grad_diff)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_attention_logits_equal_its_documents_run_alone():
    """Forward only: torch 2.13 has no FlexAttention backward on a CPU (training with it is refused there)."""
    config = tiny_llama_config()
    inputs, _, batch = packed_batch()
    attention = build_document_attention("flex_attention", config)
    model = build(config, attention.name)
    reference = build(config, "eager", model.state_dict())
    with torch.no_grad():
        logits = model(input_ids=inputs, use_cache=False, **attention.forward_kwargs(batch, "cpu")).logits.flatten(0, 1)
        alone = torch.cat([reference(input_ids=inputs.flatten()[None, first:stop], use_cache=False).logits[0]
                           for first, stop in pairwise(batch.cu_seqlens.tolist())])
    assert (logits - alone).abs().max().item() < 1e-5


@pytest.mark.parametrize("requested", ["sdpa", "varlen"])
@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_document_keywords_reach_the_attention_under_gradient_checkpointing(reentrant, requested):
    config = tiny_llama_config()
    inputs, targets, batch = packed_batch()
    attention = build_document_attention(requested, config)
    model = build(config, attention.name)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.train()
    logits = model(input_ids=inputs, use_cache=False, **attention.forward_kwargs(batch, "cpu")).logits
    masked = loss_and_grads(model, F.cross_entropy(logits.flatten(0, 1), targets.flatten()))
    loss_diff, grad_diff = differences(masked, per_document_run(config, model.state_dict()))
    assert loss_diff < 1e-6 and grad_diff < 1e-6, (loss_diff, grad_diff)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_without_masking_the_packed_batch_differs_from_its_documents(arch):
    config = CONFIGS[arch]()
    inputs, targets, _ = packed_batch()
    model = build(config, "eager")
    logits = model(input_ids=inputs, use_cache=False).logits
    plain = loss_and_grads(model, F.cross_entropy(logits.flatten(0, 1), targets.flatten()))
    loss_diff, grad_diff = differences(plain, per_document_run(config, model.state_dict()))
    assert loss_diff > 1e-4 and grad_diff > 1e-2, (loss_diff, grad_diff)


@pytest.mark.parametrize("requested", ["sdpa", "eager", "flash_attention_2", "varlen"])
def test_masked_forward_and_backward_make_no_host_sync(requested, request):
    if requested.startswith("flash"):
        request.getfixturevalue("fake_flash_kernel")
    config = tiny_llama_config()
    inputs, targets, batch = packed_batch()
    attention = build_document_attention(requested, config)
    model = build(config, attention.name)
    with HostSyncCounter() as counter:
        logits = model(input_ids=inputs, **attention.forward_kwargs(batch.as_tensors(), "cpu")).logits
        F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    assert counter.calls == []


def test_the_sync_counter_sees_the_stock_packed_sequence_detector():
    inputs, _, batch = packed_batch()
    model = build(tiny_llama_config(), "sdpa")
    with HostSyncCounter() as counter:
        model(input_ids=inputs, position_ids=torch.from_numpy(batch.position_ids))
    assert "__bool__" in counter.calls


def test_flash_kwargs_are_the_host_boundaries_of_the_flattened_batch(fake_flash_kernel):
    _, _, batch = packed_batch()
    kwargs = build_document_attention("flash_attention_2", tiny_llama_config()).forward_kwargs(batch, "cpu")
    assert kwargs["cu_seq_lens_q"] is kwargs["cu_seq_lens_k"] and kwargs["cu_seq_lens_q"].dtype == torch.int32
    assert kwargs["cu_seq_lens_q"].tolist() == batch.cu_seqlens.tolist()
    assert kwargs["cu_seq_lens_q"][-1] == 2 * SEQ_LEN
    assert kwargs["max_length_q"] == kwargs["max_length_k"] == batch.max_seqlen and type(batch.max_seqlen) is int
    assert kwargs["position_ids"].tolist() == batch.position_ids.tolist()


def test_a_forward_without_the_document_keywords_fails_loudly():
    config = tiny_llama_config()
    build_document_attention("sdpa", config)
    inputs, _, batch = packed_batch()
    with pytest.raises(ValueError, match="document_mask"):
        build(config, DOCUMENT_SDPA)(input_ids=inputs, position_ids=torch.from_numpy(batch.position_ids))


REFUSALS = {
    "varlen-sliding-window": ("varlen", tiny_mistral_config(), "runs plain causal attention per document"),
    "unknown": ("flash_attention_4", tiny_llama_config(), "supports model.attn_implementation in"),
    "no-position-ids": ("sdpa", MptConfig(), "takes no position_ids"),
    "no-attention-interface": ("sdpa", FalconConfig(), "AttentionInterface"),
    "eager-sliding-window": ("eager", tiny_mistral_config(), "drop the sliding window"),
    "flash-missing": ("flash_attention_2", tiny_llama_config(), "cannot be loaded here"),
}


@pytest.mark.parametrize("case", REFUSALS, ids=str)
def test_paths_that_cannot_mask_are_refused_with_the_fix(case):
    requested, config, reason = REFUSALS[case]
    if case == "flash-missing" and (is_flash_attn_2_available() or is_kernels_available()):
        pytest.skip("a flash kernel may be loadable here")
    with pytest.raises(UserError) as caught:
        build_document_attention(requested, config)
    message = " ".join(str(caught.value).split())
    assert reason in message and "data.document_masking" in message


def test_stacked_rows_of_several_indices_are_one_batch():
    from lmrecipe.data.documents import stack_documents

    index = np.array([0, 5, 12, 40], dtype=np.uint64)
    rows = [document_batch(index, np.array([o]), 16) for o in (0, 8, 20)]
    stacked = stack_documents(rows)
    whole = document_batch(index, np.array([0, 8, 20]), 16)
    for field in ("position_ids", "document_ids", "cu_seqlens"):
        assert np.array_equal(getattr(stacked, field), getattr(whole, field)), field
    assert stacked.max_seqlen == whole.max_seqlen
