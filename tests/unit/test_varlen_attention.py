"""Document masking without a dense mask (``lmrecipe/model/varlen.py``): the varlen plumbing through its CPU
stand-in and through ``FlashVarlen`` (the ATen flash pair, run here by a CPU kernel written to the ops' contract)
against each document run alone, the pair's call checked on meta tensors, key/value heads never repeated, a compiled
layer that does not recompile across document layouts, FlexAttention's forward, the run's attention record and the
refusals."""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig

from lmrecipe.data.documents import from_positions
from lmrecipe.errors import UserError
from lmrecipe.model import varlen
from lmrecipe.model.attention import attention_record, build_document_attention, check_attention_kernel

ROWS, SEQ, HEADS, KV_HEADS, DIM = 3, 16, 4, 2, 8
# Document lengths per row (each row sums to SEQ): a whole-row document, a row of several, a row ending in a 1-token one.
LAYOUTS = [[16], [5, 1, 7, 3], [2, 13, 1]]


def layout_batch(layouts=LAYOUTS):
    """The DocumentBatch of rows cut into documents of these lengths."""
    positions = np.concatenate([np.arange(n) for row in layouts for n in row]).reshape(len(layouts), -1)
    documents = np.stack([np.repeat(np.arange(len(row)), row) for row in layouts])
    return from_positions(positions, documents)


def qkv(dtype=torch.float32, device="cpu"):
    generator = torch.Generator().manual_seed(0)
    shapes = [(ROWS, HEADS, SEQ, DIM), (ROWS, KV_HEADS, SEQ, DIM), (ROWS, KV_HEADS, SEQ, DIM)]
    return [torch.randn(*s, generator=generator, dtype=dtype).to(device).requires_grad_() for s in shapes]


def causal_attention(query, key, value):
    """Causal softmax attention written out (no SDPA): ``[heads, tokens, dim]``, one head per key/value head."""
    scores = query @ key.transpose(-1, -2) / query.shape[-1] ** 0.5
    future = torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1)
    return scores.masked_fill(future, float("-inf")).softmax(-1) @ value


def reference(query, key, value, layouts=LAYOUTS):
    """Each document alone, key/value heads repeated by hand: ``[rows, seq, heads, dim]``."""
    group = HEADS // KV_HEADS
    rows = []
    for r, row in enumerate(layouts):
        cuts = np.cumsum([0, *row])
        rows.append(torch.cat([causal_attention(
            query[r, :, a:b], key[r, :, a:b].repeat_interleave(group, 0), value[r, :, a:b].repeat_interleave(group, 0))
            for a, b in pairwise(cuts)], dim=1))
    return torch.stack(rows).transpose(1, 2)


def varlen_attention(query, key, value, batch, scaling=None):
    kwargs = varlen.varlen_kwargs(batch, query.device)
    return varlen.document_varlen_forward(None, query, key, value, None, scaling=scaling, **kwargs)[0]


def _documents(query, key, value, cu_seqlens):
    for a, b in pairwise(cu_seqlens.tolist()):
        q, k, v = (x[a:b].transpose(0, 1).float() for x in (query, key, value))
        group = q.shape[0] // k.shape[0]
        yield a, b, q, k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)


def _probabilities(q, k, scale):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(torch.ones(len(q[0]), len(k[0]), dtype=torch.bool).triu(1),
                                                           float("-inf"))
    lse = scores.logsumexp(-1)
    return (scores - lse[..., None]).exp(), lse


def cpu_flash_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, return_debug_mask,
                      *, scale=None, window_size_left=None, window_size_right=None, seqused_k=None, alibi_slopes=None,
                      block_table=None, num_splits=None):
    """``aten::_flash_attention_forward``'s varlen contract on a CPU (causal, no dropout): the output, the
    log-sum-exp ``[heads, tokens]``, the philox seed and offset, an empty debug mask."""
    assert cum_seq_q is cum_seq_k and max_q == max_k == SEQ_OF_RUN[0] and is_causal and not return_debug_mask
    output, lse_all = torch.empty_like(query), torch.empty(query.shape[1], query.shape[0])
    for a, b, q, k, v in _documents(query, key, value, cum_seq_q):
        p, lse_all[:, a:b] = _probabilities(q, k, scale)
        output[a:b] = (p @ v).transpose(0, 1).to(query.dtype)
    return output, lse_all, torch.zeros(2, dtype=torch.uint64), torch.zeros((), dtype=torch.uint64), query.new_empty(0)


def cpu_flash_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                       is_causal, philox_seed, philox_offset, *, scale=None, window_size_left=None,
                       window_size_right=None):
    """``aten::_flash_attention_backward``'s contract on a CPU: the gradients of query, key and value, the key/value
    ones summed over each head's query group."""
    assert philox_seed.dtype == torch.uint64 and logsumexp.shape == (query.shape[1], query.shape[0])
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    grads = [torch.zeros_like(x) for x in (query, key, value)]
    for a, b, q, k, v in _documents(query, key, value, cum_seq_q):
        p, _ = _probabilities(q, k, scale)
        d_out = grad_out[a:b].transpose(0, 1).float()
        d_scores = p * (d_out @ v.transpose(-1, -2) - (d_out * (p @ v)).sum(-1, keepdim=True))
        d_k, d_v = (x.unflatten(0, (key.shape[1], -1)).sum(1)
                    for x in (d_scores.transpose(-1, -2) @ q * scale, p.transpose(-1, -2) @ d_out))
        for grad, part in zip(grads, (d_scores @ k * scale, d_k, d_v)):
            grad[a:b] = part.transpose(0, 1).to(grad.dtype)
    return tuple(grads)


SEQ_OF_RUN = [SEQ]  # the window the emulated kernel expects as max_q/max_k (a run's data.seq_len)


@pytest.fixture
def cpu_flash_kernel(monkeypatch):
    """``varlen`` takes its CUDA path (``FlashVarlen``) on this CPU, the ATen pair run by the kernels above."""
    library = torch.library.Library("aten", "IMPL")
    library.impl("_flash_attention_forward", cpu_flash_forward, "CPU")
    library.impl("_flash_attention_backward", cpu_flash_backward, "CPU")
    monkeypatch.setattr(varlen, "varlen_kernel_name", lambda device, dtype: varlen.FLASH_KERNEL)
    yield
    library._destroy()


@pytest.mark.parametrize("kernel", ["stand-in", "aten-pair"])
def test_the_plumbing_equals_each_document_alone_forward_and_gradients(kernel, request):
    if kernel == "aten-pair":
        request.getfixturevalue("cpu_flash_kernel")
    batch = layout_batch()
    assert batch.n_segments == 8 and batch.max_seqlen == SEQ  # a document spans row 0 whole
    inputs, ref_inputs = qkv(), qkv()
    output = varlen_attention(*inputs, batch)
    expected = reference(*ref_inputs)
    assert output.shape == (ROWS, SEQ, HEADS, DIM)
    grad = torch.randn(output.shape, generator=torch.Generator().manual_seed(1))
    (output * grad).sum().backward()
    (expected * grad).sum().backward()
    assert (output - expected).abs().max().item() < 1e-6
    for mine, theirs in zip(inputs, ref_inputs):
        assert mine.grad.shape == theirs.grad.shape
        assert (mine.grad - theirs.grad).abs().max().item() < 1e-6, (mine.grad - theirs.grad).abs().max()


def test_the_plumbing_fails_if_documents_are_cut_elsewhere():
    """The check above can fail: the same tensors cut at shifted offsets differ from the reference."""
    shifted = layout_batch([[16], [6, 7, 3], [2, 13, 1]])
    assert (varlen_attention(*qkv(), shifted) - reference(*qkv())).abs().max().item() > 1e-2


class SdpaShapes(TorchFunctionMode):
    """The key/value shapes every ``F.scaled_dot_product_attention`` call receives."""

    def __init__(self):
        super().__init__()
        self.key_heads: list[int] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.scaled_dot_product_attention:
            self.key_heads += [args[1].shape[-3], args[2].shape[-3]]
        return func(*args, **(kwargs or {}))


class AtenCalls(TorchDispatchMode):
    """The arguments of every ATen flash varlen call (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.calls: dict[str, list] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name.startswith("_flash_attention"):
            self.calls.setdefault(name, []).append((args, kwargs))
        return func(*args, **(kwargs or {}))


def test_the_stand_in_gets_the_key_value_heads_unrepeated():
    with SdpaShapes() as spy:
        varlen_attention(*qkv(), layout_batch()).sum().backward()
    assert spy.key_heads and set(spy.key_heads) == {KV_HEADS}


def test_the_aten_flash_pair_takes_our_positional_call_with_unrepeated_key_value_heads(monkeypatch):
    """On meta tensors torch checks the call against the ops' schemas and their shape rules: the positions, the
    forward's five results and the backward's philox seed/offset. Forward and backward get the key/value heads."""
    monkeypatch.setattr(varlen, "varlen_kernel_name", lambda device, dtype: varlen.FLASH_KERNEL)
    query, key, value = (x.detach().to("meta", torch.bfloat16).requires_grad_() for x in qkv())
    with AtenCalls() as calls:
        output = varlen_attention(query, key, value, layout_batch(), scaling=0.25)
        output.sum().backward()
    assert output.shape == (ROWS, SEQ, HEADS, DIM) and key.grad.shape == key.shape and query.grad.shape == query.shape
    (forward, forward_kwargs), = calls.calls["_flash_attention_forward"]
    (backward, backward_kwargs), = calls.calls["_flash_attention_backward"]
    assert forward_kwargs == backward_kwargs == {"scale": 0.25}
    assert [x.shape[1] for x in forward[:3]] == [HEADS, KV_HEADS, KV_HEADS]
    assert forward[3].shape == (9,) and forward[3].dtype == torch.int32 and forward[5:10] == (SEQ, SEQ, 0.0, True, False)
    assert [x.shape[1] for x in backward[1:4]] == [HEADS, KV_HEADS, KV_HEADS]
    assert backward[8:12] == (SEQ, SEQ, 0.0, True)


def tiny_llama() -> LlamaConfig:
    return LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                       intermediate_size=64, vocab_size=97, max_position_embeddings=64)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_attention_forward_equals_each_document_alone():
    attention = build_document_attention("flex_attention", tiny_llama())
    query, key, value = (x.detach() for x in qkv())  # no backward on a CPU: inputs that need none
    kwargs = attention.forward_kwargs(layout_batch(), "cpu")
    with torch.no_grad():
        output = varlen.document_flex_forward(None, query, key, value, None, **kwargs)[0]
        expected = reference(query, key, value)
    assert (output - expected).abs().max().item() < 1e-5, (output - expected).abs().max()


def test_the_record_names_the_kernel_and_the_sdpa_backend(monkeypatch):
    config = tiny_llama()
    assert attention_record("varlen", True, config, SEQ, "fp32", "cpu") == {
        "implementation": "varlen", "kernel": varlen.STAND_IN, "sdpa_backend": "FLASH_ATTENTION"}
    assert attention_record("eager", True, config, SEQ, "fp32", "cpu")["sdpa_backend"] is None
    masked = attention_record("sdpa", True, config, SEQ, "bf16", "cpu")
    assert masked["kernel"] == "sdpa under a dense block-causal mask" and masked["sdpa_backend"] in {"FLASH_ATTENTION", "MATH"}
    seen = []
    monkeypatch.setattr(torch, "_fused_sdp_choice", lambda *a, **k: seen.append((a, k)) or 0)  # 0: the math backend
    assert attention_record("sdpa", False, config, SEQ, "bf16", "cpu")["sdpa_backend"] == "MATH"
    (query, key, _), kwargs = seen[0]
    assert query.shape == (1, HEADS, SEQ, DIM) and key.shape == (1, KV_HEADS, SEQ, DIM) and query.dtype == torch.bfloat16
    assert kwargs == {"attn_mask": None, "is_causal": True, "enable_gqa": True}


def test_flex_attention_training_is_refused_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError) as caught:
        check_attention_kernel("flex_attention")
    message = " ".join(str(caught.value).split())
    assert "no FlexAttention backward on a CPU" in message and "model.attn_implementation=varlen" in message
    check_attention_kernel("varlen")  # runs anywhere


def test_varlen_refuses_sliding_windows():
    config = MistralConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                           intermediate_size=64, vocab_size=97, sliding_window=4)
    for requested in ("varlen", "flex_attention"):
        with pytest.raises(UserError) as caught:
            build_document_attention(requested, config)
        assert "sliding_window=4. Use model.attn_implementation=sdpa" in " ".join(str(caught.value).split())


def test_a_varlen_forward_without_the_offsets_fails_loudly():
    attention = build_document_attention("varlen", tiny_llama())
    model = AutoModelForCausalLM.from_config(tiny_llama(), attn_implementation=attention.name)
    with pytest.raises(ValueError, match="varlen_cu_seqlens"):
        model(input_ids=torch.zeros(1, 4, dtype=torch.long))


STEPS = 6
COUNTS: list[dict] = []  # dynamo's counters after each step of the last runs


def dynamo_counts() -> dict:
    from torch._dynamo.utils import counters

    return {"frames": counters["frames"]["total"], "graphs": counters["stats"]["unique_graphs"],
            "graph_breaks": sum(counters["graph_break"].values())}


def train_fp32(out_dir, data, attn_implementation: str, compile_mode: str = "none") -> tuple[list[float], dict]:
    """``STEPS`` fp32 steps of the tiny model (grouped-query: 2 key/value heads) on short documents, in this process
    (of a run one step longer: no validation); the logged losses and ``run_meta.json``."""
    import json

    from helpers import TINY_OVERRIDES

    from lmrecipe.config import load_config
    from lmrecipe.train import setup
    from lmrecipe.train.trainer import build_trainer

    cfg = load_config("recipes/tiny.yaml", [
        f"out_dir={out_dir}", f"data.path={data}", *TINY_OVERRIDES, f"train.max_steps={STEPS + 1}",
        "train.precision=fp32", "model.num_kv_heads=2", "train.eval_every_steps=0", "checkpoint.every_steps=0",
        "checkpoint.resume=none", f"model.attn_implementation={attn_implementation}", f"train.compile={compile_mode}"])
    run = setup.build_run(cfg, out_dir)
    trainer = build_trainer(run, out_dir)
    trainer.start()
    try:
        for _ in range(STEPS):
            trainer.step()
            COUNTS.append(dynamo_counts())
    finally:
        trainer.close()
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return [row["loss"] for row in rows if "loss" in row], json.loads((out_dir / "run_meta.json").read_text())


@pytest.fixture(scope="module")
def dense_run(tmp_path_factory, short_docs) -> tuple[list[float], dict]:
    return train_fp32(tmp_path_factory.mktemp("sdpa"), short_docs, "sdpa")


def test_varlen_trains_as_the_dense_mask(tmp_path, short_docs, caplog, monkeypatch, dense_run):
    import logging

    dense, dense_meta = dense_run
    calls = []
    stand_in = varlen.per_document_sdpa
    monkeypatch.setattr(varlen, "per_document_sdpa", lambda *a, **k: calls.append(a[1].shape) or stand_in(*a, **k))
    with caplog.at_level(logging.INFO):
        mine, meta = train_fp32(tmp_path / "varlen", short_docs, "varlen")
    assert len(dense) == len(mine) == STEPS and dense[0] != dense[-1]
    # every layer of every training forward went through the stand-in, with the 2 key/value heads unrepeated
    assert len(calls) >= 2 * 2 * STEPS and {shape[1] for shape in calls} == {2}
    assert max(abs(a - b) for a, b in zip(dense, mine)) <= 1e-5, (dense, mine)
    assert meta["attention"] == {"implementation": "varlen", "kernel": varlen.STAND_IN, "sdpa_backend": "FLASH_ATTENTION"}
    assert dense_meta["attention"]["kernel"] == "sdpa under a dense block-causal mask"
    assert f"attention: varlen, kernel: {varlen.STAND_IN}, SDPA backend: FLASH_ATTENTION; model.kernels=auto: none" \
        in caplog.text and meta["kernels"] == "none"  # auto, without a GPU: transformers' own modules


@pytest.mark.parametrize("overrides", [["model.attn_implementation=flex_attention"],
                                       ["model.attn_implementation=varlen", "data.document_masking=false"]],
                         ids=["flex-on-cpu", "varlen-without-masking"])
def test_start_up_refuses_what_cannot_train_here(tmp_path, short_docs, monkeypatch, overrides):
    from helpers import TINY_OVERRIDES

    from lmrecipe.config import load_config
    from lmrecipe.train import setup

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError) as caught:
        cfg = load_config("recipes/tiny.yaml", [f"out_dir={tmp_path}", f"data.path={short_docs}", *TINY_OVERRIDES,
                                                *overrides])
        setup.build_run(cfg, tmp_path)
    message = " ".join(str(caught.value).split())
    assert ("no FlexAttention backward on a CPU" in message if "flex" in overrides[0] else
            "Set data.document_masking=true, or model.attn_implementation=sdpa" in message), message
    assert not (tmp_path / "run_meta.json").exists()


@pytest.mark.slow
def test_a_compiled_layer_runs_the_aten_pair_without_recompiling_across_layouts(tmp_path, short_docs, dense_run,
                                                                              cpu_flash_kernel):
    """train.compile=layers on the CUDA path: one graph for both layers, compiled at step 1, no graph break and no
    recompile while the document layouts change (max_q = max_k = the window, the offsets' length marked dynamic)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    COUNTS.clear()
    SEQ_OF_RUN[0] = 32  # the tiny runs' data.seq_len
    try:
        compiled, _ = train_fp32(tmp_path, short_docs, "varlen", "layers")
    finally:
        SEQ_OF_RUN[0] = SEQ
    assert COUNTS[0] == COUNTS[-1] == {"frames": 1, "graphs": 1, "graph_breaks": 0}, COUNTS
    assert max(abs(a - b) for a, b in zip(dense_run[0], compiled)) <= 1e-5, (dense_run[0], compiled)


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_the_stand_in_on_a_gpu_is_a_warning_naming_the_fix(device, caplog):
    import logging
    from types import SimpleNamespace

    from helpers import ROOT

    from lmrecipe.config import load_config
    from lmrecipe.data.batches import BatchLayout
    from lmrecipe.parallel.topology import Topology
    from lmrecipe.train.callbacks.reporting import log_start

    run = SimpleNamespace(cfg=load_config(ROOT / "recipes" / "tiny.yaml", []), model=torch.nn.Linear(2, 2),
                          n_params=10**6, n_active_params=None,
                          runtime=SimpleNamespace(topology=Topology(1), batch=BatchLayout(8, 8, 1, 0), precision="fp32"),
                          accelerator=SimpleNamespace(is_main_process=False, device=torch.device(device)))
    with caplog.at_level(logging.INFO):
        log_start(run, {"implementation": "varlen", "kernel": varlen.STAND_IN, "sdpa_backend": "MATH"}, "none")
    warned = [r.message for r in caplog.records if r.levelno == logging.WARNING]
    assert warned == (["model.attn_implementation=varlen runs its per-document stand-in on this GPU: torch's flash "
                       "variable-length kernel takes bf16/fp16 (train.precision=fp32) from a torch built with flash "
                       "attention. Set train.precision=bf16, or model.attn_implementation=sdpa."]
                      if device == "cuda" else [])
