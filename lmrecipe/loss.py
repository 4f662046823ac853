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

**The z-loss** (``train.z_loss``): ``coef * logsumexp(logits)^2`` averaged over the target tokens, which pulls the
log-partition towards 0 so the logits cannot drift upwards together (PaLM's auxiliary loss). :func:`training_loss`
adds it to the training objective only; validation, perplexity and ``eval.py`` use :func:`causal_lm_loss`, the
language-model loss alone. The chunked path takes it from the log-sum-exp it already keeps (a second output of
:class:`ChunkedCrossEntropy`), so no logits are held for it either.

**An MoE model's router** (``model.num_experts`` > 0): its load-balancing loss, as the model class returns it
(``aux_loss``), times ``model.router_aux_loss_coef`` is a third term of the training objective, logged apart; the
routers' logits also give the tokens each expert received (:func:`expert_tokens`, the load balance of a logged step).

With document masking (``data.document_masking``), every forward also receives the keyword arguments that carry the
batch's document boundaries (``DocumentAttention.forward_kwargs``): position ids restarting at each document and
the mask or the variable-length offsets of the attention path.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, NamedTuple

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

    ``hidden``: ``[tokens, dim]``; ``weight``: ``[vocab, dim]``; returns fp32 ``[tokens]`` losses and their fp32
    ``[tokens]`` log-sum-exps (differentiable too: the z-loss's input). The logits are computed in the weight's dtype
    and upcast to fp32, as the full path does; their gradient goes back in that dtype. ``max_abs_logit``: a 0-dim
    fp32 tensor that receives the largest absolute logit seen (None: not measured).
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_tokens: int, max_abs_logit: torch.Tensor | None = None):
        lse = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        losses = torch.empty_like(lse)
        for start in range(0, hidden.shape[0], chunk_tokens):
            rows = slice(start, start + chunk_tokens)
            logits = _fp32(F.linear(hidden[rows], weight, bias))
            target_logit = logits.gather(1, targets[rows, None]).squeeze(1)
            if max_abs_logit is not None:
                torch.maximum(max_abs_logit, logits.abs().amax(), out=max_abs_logit)
            # log-sum-exp in place: one chunk of logits is the only chunk-sized tensor alive.
            top = logits.amax(dim=1, keepdim=True)
            lse[rows] = logits.sub_(top).exp_().sum(dim=1).log_().add_(top.squeeze(1))
            losses[rows] = lse[rows] - target_logit
            del logits  # before the next chunk's logits exist
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.chunk_tokens = chunk_tokens
        ctx.set_materialize_grads(False)  # an unused log-sum-exp (no z-loss) costs nothing in the backward
        return losses, lse

    @staticmethod
    def backward(ctx, grad_losses, grad_lse):
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if bias is not None and ctx.needs_input_grad[2] else None
        if grad_losses is None:
            grad_losses = torch.zeros_like(lse)
        for start in range(0, hidden.shape[0], ctx.chunk_tokens):
            rows = slice(start, start + ctx.chunk_tokens)
            # d loss / d logits = softmax - one_hot(target), times the incoming gradient of each token's loss;
            # d lse / d logits = softmax, times the incoming gradient of each token's log-sum-exp.
            grad_logits = _fp32(F.linear(hidden[rows], weight, bias)).sub_(lse[rows, None]).exp_()
            if grad_lse is None:  # the loss alone: the exact operations of the path without a z-loss
                grad_logits.scatter_add_(1, targets[rows, None], grad_logits.new_full((grad_logits.shape[0], 1), -1.0))
                grad_logits.mul_(grad_losses[rows, None])
            else:
                grad_logits.mul_((grad_losses[rows] + grad_lse[rows])[:, None])
                grad_logits.scatter_add_(1, targets[rows, None], -grad_losses[rows, None])
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
        return grad_hidden, grad_weight, grad_bias, None, None, None


def _fp32(logits: torch.Tensor) -> torch.Tensor:
    """fp32 logits that may be written in place: a copy of lower-precision ones, fp32 ones as they are (fresh)."""
    return logits if logits.dtype == torch.float32 else logits.float()


class ChunkedLossHead(torch.nn.Module):
    """The model's output layer, returning each token's loss instead of its logits while targets are set
    (:meth:`targets_set`), and ordinary logits otherwise (generation, a forward without targets).

    Holds the original layer's parameters themselves (``weight``, ``bias``), so names, ties to the input embedding,
    ZeRO-3 partitions and checkpoints are unchanged. With ``with_lse`` the output is ``[..., 2]``: each token's loss
    and its log-sum-exp. While :attr:`max_abs_logit` is a tensor, every forward with targets raises it to the largest
    absolute logit it computes (the per-layer instruments' figure; the logits are never whole).
    """

    def __init__(self, head: torch.nn.Linear, chunk_tokens: int):
        super().__init__()
        self.weight = head.weight
        self.bias = head.bias
        self.chunk_tokens = chunk_tokens
        self.targets: torch.Tensor | None = None
        self.with_lse = False
        self.max_abs_logit: torch.Tensor | None = None

    @contextlib.contextmanager
    def targets_set(self, targets: torch.Tensor, with_lse: bool = False) -> Iterator[None]:
        self.targets, self.with_lse = targets, with_lse
        try:
            yield
        finally:
            self.targets, self.with_lse = None, False

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.targets is None:
            return F.linear(hidden, self.weight, self.bias)
        if hidden.shape[:-1] != self.targets.shape:
            raise ValueError(f"chunked loss: hidden states {tuple(hidden.shape)} do not match the targets "
                             f"{tuple(self.targets.shape)}")
        losses, lse = ChunkedCrossEntropy.apply(hidden.flatten(0, -2), self.weight, self.bias, self.targets.flatten(),
                                                self.chunk_tokens, self.max_abs_logit)
        if self.with_lse:
            return torch.stack([losses, lse], dim=-1).view(*self.targets.shape, 2)
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


IGNORE_INDEX = -100
"""A target that counts in no average (``F.cross_entropy``'s default): the z-loss skips the tokens the loss skips."""


class LossTerms(NamedTuple):
    """The training objective's terms for one micro-batch; their sum is backpropagated, each is logged apart."""

    lm: torch.Tensor
    """The mean language-model loss (what validation, perplexity and ``eval.py`` report)."""
    z: torch.Tensor | None = None
    """The z-loss term, already times ``train.z_loss``; None: off."""
    aux: torch.Tensor | None = None
    """The router's load-balancing loss, already times ``model.router_aux_loss_coef``; None: a dense model or off."""
    expert_tokens: torch.Tensor | None = None
    """Tokens routed to each expert of each MoE layer, ``[layers, experts]`` (fp32, this rank's micro-batch, never
    read on the host here); None: a dense model."""

    def objective(self) -> torch.Tensor:
        """The sum that is backpropagated: the language-model loss and the terms that are on."""
        total = self.lm
        for term in (self.z, self.aux):
            if term is not None:
                total = total + term
        return total


def expert_tokens(router_logits, experts_per_token: int) -> torch.Tensor | None:
    """Tokens routed to each expert of each layer, ``[layers, experts]``, from the routers' logits (a tuple of
    ``[tokens, experts]``, one per MoE layer): each token counts once for each of its top ``experts_per_token``
    experts. A scatter-add, so nothing is read on the host. None without router logits (a dense model)."""
    if not router_logits:
        return None
    counts = []
    for logits in router_logits:
        chosen = logits.detach().topk(experts_per_token, dim=-1).indices.flatten()
        counts.append(torch.zeros(logits.shape[-1], dtype=torch.float32, device=logits.device).scatter_add_(
            0, chosen, torch.ones_like(chosen, dtype=torch.float32)))
    return torch.stack(counts)


def training_loss(model, inputs: torch.Tensor, targets: torch.Tensor, z_loss: float = 0.0,
                  model_kwargs: dict | None = None, aux_loss_coef: float = 0.0,
                  experts_per_token: int = 0) -> LossTerms:
    """The training objective's terms: the mean language-model loss (:func:`causal_lm_loss`'s), the z-loss
    ``z_loss * mean(logsumexp(logits)^2)`` over the same target tokens (None when ``z_loss`` is 0), and an MoE model's
    router load-balancing loss times ``aux_loss_coef`` (None when 0 or when the model returns none). The caller
    backpropagates their sum (:meth:`LossTerms.objective`) and logs them apart. ``experts_per_token`` > 0 (an MoE
    model): the tokens each expert received are counted too (:func:`expert_tokens`).
    """
    head = chunked_head(model)
    with_lse = z_loss != 0
    if head is not None:
        with head.targets_set(targets, with_lse=with_lse):
            outputs = model(input_ids=inputs, **(model_kwargs or {}))
        per_token = outputs.logits
        lm_loss = (per_token[..., 0] if with_lse else per_token).mean()
        lse = per_token[..., 1] if with_lse else None
    else:
        outputs = model(input_ids=inputs, **(model_kwargs or {}))
        logits = outputs.logits.float()
        lm_loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        lse = torch.logsumexp(logits, dim=-1) if with_lse else None
    z_term = None
    if lse is not None:
        counted = targets != IGNORE_INDEX
        z_term = z_loss * (lse.square() * counted).sum() / counted.sum().clamp_min(1)
    aux = getattr(outputs, "aux_loss", None)
    aux_term = aux_loss_coef * aux if aux_loss_coef and isinstance(aux, torch.Tensor) else None
    counts = expert_tokens(getattr(outputs, "router_logits", None), experts_per_token) if experts_per_token else None
    return LossTerms(lm_loss, z_term, aux_term, counts)


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
