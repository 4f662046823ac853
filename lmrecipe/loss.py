"""The training objective and the validation loss, shared by the training loop and ``eval.py``.

**The chunked loss** (``train.loss_chunk_tokens``). The full path materialises ``[rows, seq, vocab]`` logits and an
fp32 copy; at Llama-3's 128,256-token vocabulary, 8 x 2,048 tokens are 8.4 GB before the backward doubles them.
:func:`use_chunked_loss` swaps the model's output layer for a :class:`ChunkedLossHead` holding the same weight (same
parameter object, same state-dict names, ties kept) that returns each token's loss instead of its logits. Its
:class:`ChunkedCrossEntropy` computes the logits of ``chunk_tokens`` tokens at a time: the forward keeps only each
token's log-sum-exp, the backward recomputes a chunk's logits and turns them into the gradients of the hidden states
and of the weight. Memory for logits is one chunk (``chunk_tokens x vocab`` fp32, twice while its gradient forms)
instead of all of them; the price is one more output-layer matmul per token (the recomputation). The gradients are
ordinary autograd outputs, so DDP's and DeepSpeed's gradient hooks (ZeRO-3 gathers the weight for the head's forward
and backward like any module's) and gradient accumulation see nothing unusual, and nothing is read on the host.

Why not DeepSpeed's ``TiledFusedLogitsLoss``: it runs the backward inside the forward and writes the output layer's
gradient into ``.grad`` there (outside DDP's reducer and the accumulation context), and its backward compares the
incoming gradient with 1.0 on the host, a device sync on every micro-batch. cut-cross-entropy needs triton and Liger
a GPU; this file is plain torch and runs wherever the model does.

With document masking (``data.document_masking``), every forward also receives the keyword arguments that carry the
batch's document boundaries (``DocumentAttention.forward_kwargs``): position ids restarting at each document and
the mask or the variable-length offsets of the attention path.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn.functional as F

from lmrecipe.attention import DocumentAttention
from lmrecipe.data.batches import ValBatches
from lmrecipe.errors import fail


def forward_kwargs(attention: DocumentAttention | None, documents, device: torch.device) -> dict:
    """The document keywords of one forward (none without document masking)."""
    if attention is None:
        return {}
    if documents is None:
        raise ValueError("document masking is on but the batch carries no document boundaries")
    return attention.forward_kwargs(documents, device)


class ChunkedCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of ``hidden @ weight.T (+ bias)`` against ``targets``, ``chunk_tokens`` tokens at a time.

    ``hidden``: ``[tokens, dim]``; ``weight``: ``[vocab, dim]``; returns fp32 ``[tokens]``. The logits are computed in
    the weight's dtype and upcast to fp32, as the full path does; their gradient goes back in that dtype.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_tokens: int):
        lse = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        losses = torch.empty_like(lse)
        for start in range(0, hidden.shape[0], chunk_tokens):
            rows = slice(start, start + chunk_tokens)
            logits = _fp32(F.linear(hidden[rows], weight, bias))
            target_logit = logits.gather(1, targets[rows, None]).squeeze(1)
            # log-sum-exp in place: one chunk of logits is the only chunk-sized tensor alive.
            top = logits.amax(dim=1, keepdim=True)
            lse[rows] = logits.sub_(top).exp_().sum(dim=1).log_().add_(top.squeeze(1))
            losses[rows] = lse[rows] - target_logit
            del logits  # before the next chunk's logits exist
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.chunk_tokens = chunk_tokens
        return losses

    @staticmethod
    def backward(ctx, grad_losses):
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if bias is not None and ctx.needs_input_grad[2] else None
        for start in range(0, hidden.shape[0], ctx.chunk_tokens):
            rows = slice(start, start + ctx.chunk_tokens)
            # d loss / d logits = softmax - one_hot(target), times the incoming gradient of each token's loss.
            grad_logits = _fp32(F.linear(hidden[rows], weight, bias)).sub_(lse[rows, None]).exp_()
            grad_logits.scatter_add_(1, targets[rows, None], grad_logits.new_full((grad_logits.shape[0], 1), -1.0))
            grad_logits.mul_(grad_losses[rows, None])
            grad_logits = grad_logits.to(hidden.dtype)
            if grad_hidden is not None:
                grad_hidden[rows] = grad_logits @ weight
            if grad_weight is not None:  # summed in fp32 over the chunks; the matmul runs in the model's dtype
                if hidden.dtype == torch.float32:
                    grad_weight.addmm_(grad_logits.t(), hidden[rows])
                else:
                    grad_weight.add_(grad_logits.t() @ hidden[rows])
            if grad_bias is not None:
                grad_bias += grad_logits.float().sum(0)
            del grad_logits  # before the next chunk's logits exist
        grad_weight = None if grad_weight is None else grad_weight.to(weight.dtype)
        grad_bias = None if grad_bias is None else grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None


def _fp32(logits: torch.Tensor) -> torch.Tensor:
    """fp32 logits that may be written in place: a copy of lower-precision ones, fp32 ones as they are (fresh)."""
    return logits if logits.dtype == torch.float32 else logits.float()


class ChunkedLossHead(torch.nn.Module):
    """The model's output layer, returning each token's loss instead of its logits while targets are set
    (:meth:`targets_set`), and ordinary logits otherwise (generation, a forward without targets).

    Holds the original layer's parameters themselves (``weight``, ``bias``), so names, ties to the input embedding,
    ZeRO-3 partitions and checkpoints are unchanged.
    """

    def __init__(self, head: torch.nn.Linear, chunk_tokens: int):
        super().__init__()
        self.weight = head.weight
        self.bias = head.bias
        self.chunk_tokens = chunk_tokens
        self.targets: torch.Tensor | None = None

    @contextlib.contextmanager
    def targets_set(self, targets: torch.Tensor) -> Iterator[None]:
        self.targets = targets
        try:
            yield
        finally:
            self.targets = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.targets is None:
            return F.linear(hidden, self.weight, self.bias)
        if hidden.shape[:-1] != self.targets.shape:
            raise ValueError(f"chunked loss: hidden states {tuple(hidden.shape)} do not match the targets "
                             f"{tuple(self.targets.shape)}")
        losses = ChunkedCrossEntropy.apply(hidden.flatten(0, -2), self.weight, self.bias, self.targets.flatten(),
                                           self.chunk_tokens)
        return losses.view(self.targets.shape)


def use_chunked_loss(model: torch.nn.Module, chunk_tokens: int) -> None:
    """Swap ``model``'s output layer (``get_output_embeddings``, a Linear) for a :class:`ChunkedLossHead`."""
    head = model.get_output_embeddings()
    if isinstance(head, ChunkedLossHead):
        head.chunk_tokens = chunk_tokens
        return
    if type(head) is not torch.nn.Linear:
        raise fail(f"train.loss_chunk_tokens: the output layer of {type(model).__name__} is a {type(head).__name__}, "
                   "not a Linear layer, so the chunked loss cannot replace it. Set train.loss_chunk_tokens=0.")
    model.set_output_embeddings(ChunkedLossHead(head, chunk_tokens))


def chunked_head(model) -> ChunkedLossHead | None:
    """The chunked-loss head of a model, through the DDP / DeepSpeed (``module``) and torch.compile wrappers."""
    for attr in ("module", "_orig_mod", "module"):
        model = getattr(model, attr, model)
    get = getattr(model, "get_output_embeddings", None)
    head = get() if get is not None else None
    return head if isinstance(head, ChunkedLossHead) else None


def causal_lm_loss(model, inputs: torch.Tensor, targets: torch.Tensor, reduction: str = "mean",
                   model_kwargs: dict | None = None) -> torch.Tensor:
    """Next-token cross-entropy in fp32 (targets are the inputs shifted by one, so no token is dropped).

    ``model_kwargs``: further keyword arguments of the forward (the document boundaries, :func:`forward_kwargs`).
    With a :class:`ChunkedLossHead` the model returns the per-token losses itself and no logits are held.
    """
    head = chunked_head(model)
    if head is not None:
        with head.targets_set(targets):
            per_token = model(input_ids=inputs, **(model_kwargs or {})).logits
        return per_token.mean() if reduction == "mean" else per_token
    logits = model(input_ids=inputs, **(model_kwargs or {})).logits
    loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction=reduction)
    return loss if reduction == "mean" else loss.view(targets.shape)


@torch.no_grad()
def validation_loss(model, val_batches: ValBatches, accelerator, attention: DocumentAttention | None = None) -> float:
    """Mean validation loss over the fixed windows, identical for any split over ranks (one all-reduce).

    ``attention``: the document-masking attention the model was built with (None: plain causal windows).
    """
    was_training = model.training
    model.eval()
    device = accelerator.device
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for inputs, targets, valid, documents in val_batches:
        kwargs = forward_kwargs(attention, documents, device)
        per_token = causal_lm_loss(model, inputs.to(device), targets.to(device), "none", kwargs)
        total[0] += (per_token.sum(dim=1).double() * valid.to(device)).sum()
        total[1] += valid.sum() * targets.shape[1]
    total = accelerator.reduce(total, reduction="sum")
    model.train(was_training)
    return (total[0] / total[1]).item()
