"""The chunked loss head in the forward's compute dtype: under bf16 autocast over fp32 weights no vocabulary-sized
matmul runs in fp32 in either pass; the training head forms its gradients in the forward (no matmul in its backward);
its loss, z term and gradients equal full logits in fp32 and stay within bf16 rounding of them, no worse than the
full-logits path's own bf16 error; ignored targets count in neither mean."""

from __future__ import annotations

import contextlib
import copy
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, LlamaConfig

from lmrecipe.model.loss import IGNORE_INDEX, causal_lm_loss, training_loss, use_chunked_loss

VOCAB, DIM, ROWS, SEQ, CHUNK = 1000, 64, 3, 41, 16
CHUNKS = -(-ROWS * SEQ // CHUNK)
Z_LOSS = 1e-2
aten = torch.ops.aten
MATMULS = {aten.mm, aten.addmm, aten.addmm_, aten.bmm, aten.baddbmm, aten.baddbmm_, aten.matmul, aten.addbmm,
           aten.addbmm_, aten._addmm_activation}
"""Every matmul overload packet (``out=`` and ``out_dtype`` forms are overloads of these)."""


class MatmulDtypes(TorchDispatchMode):
    """Counts the matmuls with an operand or a result of the vocabulary's size, by (pass, dtype of the multiplied
    operands): ``phase`` names the pass being recorded."""

    def __init__(self):
        super().__init__()
        self.phase = "forward"
        self.seen: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in MATMULS:
            tensors = [a for a in (*args, *(kwargs or {}).values(), out) if isinstance(a, torch.Tensor)]
            if any(VOCAB in t.shape for t in tensors):
                operands = [a for a in args if isinstance(a, torch.Tensor)][-2:]  # (mat1, mat2) of every form
                self.seen[self.phase, *sorted({str(t.dtype).removeprefix("torch.") for t in operands})] += 1
        return out


class TinyLM(torch.nn.Module):
    """A language model reduced to its head: token i's hidden state is row i of ``hidden``, so the gradient of the
    hidden states is ``hidden.grad`` itself (the inputs are ``arange``)."""

    def __init__(self):
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.hidden = torch.nn.Parameter(torch.randn(ROWS * SEQ, DIM, generator=generator))
        self.lm_head = torch.nn.Linear(DIM, VOCAB, bias=False)
        with torch.no_grad():  # logits of a few units: a peaked softmax and a z term that moves the gradients
            self.lm_head.weight.copy_(torch.randn(VOCAB, DIM, generator=generator) * 3 / DIM ** 0.5)

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, head):
        self.lm_head = head

    def forward(self, input_ids):
        return SimpleNamespace(logits=self.lm_head(F.embedding(input_ids, self.hidden)))


def targets_with_ignored() -> torch.Tensor:
    targets = torch.randint(0, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(1))
    targets[0, :5] = IGNORE_INDEX
    targets[2, 7::9] = IGNORE_INDEX
    return targets


def head_pass(model, autocast: bool, recorder: MatmulDtypes | None = None):
    """The training objective's terms and the gradients of the hidden states and of the head's weight."""
    inputs = torch.arange(ROWS * SEQ).view(ROWS, SEQ)
    model.zero_grad(set_to_none=True)
    with recorder if recorder is not None else contextlib.nullcontext():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            terms = training_loss(model, inputs, targets_with_ignored(), Z_LOSS)
        if recorder is not None:
            recorder.phase = "backward"
        terms.objective().backward()
    weight = model.get_output_embeddings().weight
    return {"lm": terms.lm.detach().float(), "z": terms.z.detach().float(), "hidden": model.hidden.grad.float(),
            "weight": weight.grad.float()}


def max_relative(got: torch.Tensor, want: torch.Tensor) -> float:
    """Max-norm relative difference max|got - want| / max|want|."""
    return ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()


def chunked(model):
    copied = copy.deepcopy(model)
    use_chunked_loss(copied, CHUNK)
    return copied


def test_the_recorder_sees_an_in_place_fp32_weight_gradient_and_out_forms():
    """The test below cannot pass by a blind recorder: autocast never casts an in-place or ``out=`` matmul."""
    grad = torch.zeros(VOCAB, DIM)
    a, b = torch.randn(CHUNK, VOCAB), torch.randn(CHUNK, DIM)
    with MatmulDtypes() as recorder, torch.autocast("cpu", dtype=torch.bfloat16):
        grad.addmm_(a.t(), b)
        torch.mm(a.t(), b, out=grad)
        torch.mm(a.t().bfloat16(), b.bfloat16())
    assert recorder.seen == {("forward", "float32"): 2, ("forward", "bfloat16"): 1}


def test_no_vocabulary_sized_matmul_runs_in_fp32_under_bf16_autocast():
    """The training head: three bf16 GEMMs per chunk in the forward (logits, hidden and weight gradients), none in the
    backward; the full-logits path's own matmuls are bf16 as well (the reference the head must match)."""
    recorder = MatmulDtypes()
    head_pass(chunked(TinyLM()), autocast=True, recorder=recorder)
    assert recorder.seen == {("forward", "bfloat16"): 3 * CHUNKS}
    full = MatmulDtypes()
    head_pass(TinyLM(), autocast=True, recorder=full)
    assert sum(full.seen.values()) > 0 and all(key[1:] == ("bfloat16",) for key in full.seen)


def test_the_per_token_backward_runs_in_the_forwards_dtype():
    """The forward-only path's backward (a caller that backpropagates per-token losses) recomputes the logits and forms
    both gradients in bf16 too, its in-place weight-gradient GEMM included."""
    model = chunked(TinyLM())
    inputs = torch.arange(ROWS * SEQ).view(ROWS, SEQ)
    with MatmulDtypes() as recorder:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = causal_lm_loss(model, inputs, targets_with_ignored())
        recorder.phase = "backward"
        loss.backward()
    assert recorder.seen == {("forward", "bfloat16"): CHUNKS, ("backward", "bfloat16"): 3 * CHUNKS}


def test_the_training_head_equals_full_logits_in_fp32():
    want = head_pass(TinyLM(), autocast=False)
    got = head_pass(chunked(TinyLM()), autocast=False)
    assert want["z"] > 1e-3 * want["lm"]  # the z term is a sizeable part of the gradient
    for name in want:
        assert max_relative(got[name], want[name]) <= 1e-6, name


@pytest.mark.parametrize("precision", ["autocast", "bf16 weights"])
def test_the_training_head_in_bf16_is_no_worse_than_full_logits(precision):
    """Against the fp32 reference: within 2e-2 (max-norm) and at most 1.5x the full-logits path's own bf16 error."""
    reference = head_pass(TinyLM(), autocast=False)
    model = TinyLM() if precision == "autocast" else TinyLM().to(torch.bfloat16)
    full = head_pass(model, autocast=precision == "autocast")
    got = head_pass(chunked(model), autocast=precision == "autocast")
    for name in reference:
        error, full_error = max_relative(got[name], reference[name]), max_relative(full[name], reference[name])
        assert error <= 2e-2 and error <= 1.5 * max(full_error, 1e-6), (name, error, full_error)


def test_ignored_targets_and_document_positions_equal_full_logits_through_a_model():
    """A Llama with restarting position ids: the training head's terms and every parameter's gradient, and the
    per-token path's losses, equal the full path's with targets set to IGNORE_INDEX."""
    torch.manual_seed(0)
    full = AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=VOCAB, hidden_size=DIM, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128), attn_implementation="sdpa")
    model = chunked(full)
    inputs = torch.randint(0, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(2))
    targets = targets_with_ignored()
    kwargs = {"position_ids": torch.cat([torch.arange(17), torch.arange(SEQ - 17)]).expand(ROWS, -1)}
    results = []
    for each in (full, model):
        each.zero_grad(set_to_none=True)
        terms = training_loss(each, inputs, targets, Z_LOSS, kwargs)
        terms.objective().backward()
        with torch.no_grad():
            per_token = causal_lm_loss(each, inputs, targets, "none", kwargs)
        results.append((terms.lm, terms.z, per_token, {n: p.grad for n, p in each.named_parameters()}))
    (lm, z, per_token, grads), (got_lm, got_z, got_per_token, got_grads) = results
    assert max_relative(got_lm, lm) <= 1e-6 and max_relative(got_z, z) <= 1e-6
    assert max_relative(got_per_token, per_token) <= 1e-6 and torch.all(got_per_token[targets == IGNORE_INDEX] == 0)
    assert max(max_relative(got_grads[name], grads[name]) for name in grads) <= 1e-6
