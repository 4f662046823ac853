"""The training objective and the validation loss, shared by the training loop and ``eval.py``.

**The chunked loss** (``train.loss_chunk_tokens``). The full path materialises ``[rows, seq, vocab]`` logits and an
fp32 copy; at Llama-3's 128,256-token vocabulary, 8 x 2,048 tokens are 8.4 GB before the backward doubles them.
:func:`use_chunked_loss` swaps the model's output layer for a :class:`ChunkedLossHead` holding the same weight (same
parameter object, same state-dict names, ties kept) that returns losses instead of logits, computing the logits of
``chunk_tokens`` tokens at a time. For training (:func:`training_loss`) it returns the reduced terms (mean loss, z term)
from :class:`ChunkedObjective`, which turns each chunk's logits into the gradients of the hidden states and of the
weight in the forward, while they exist: three head GEMMs per token, as with full logits, and the backward only scales
those gradients. Validation and ``eval.py`` take each token's loss from :class:`ChunkedCrossEntropy` (forward only;
its backward, for a caller that wants one, recomputes the chunk's logits). Memory for logits is one chunk
(``chunk_tokens x vocab`` fp32, and the chunk's gradient in the compute dtype) instead of all of them. The GEMMs run in
the forward's compute dtype (autocast's, else the weight's; recorded for a backward that runs outside autocast), and the
weight's gradient is summed over the chunks in fp32 (on CUDA by one GEMM per chunk writing fp32). The gradients are
ordinary autograd outputs, so DDP's and DeepSpeed's gradient hooks (ZeRO-3 gathers the weight for the head's forward
like any module's) and gradient accumulation see nothing unusual, and nothing is read on the host.

Why not DeepSpeed's ``TiledFusedLogitsLoss``: it writes the output layer's gradient into ``.grad`` during the forward
(outside DDP's reducer and the accumulation context; :class:`ChunkedObjective` hands its gradients to autograd in the
backward), and its backward compares the incoming gradient with 1.0 on the host, a device sync on every micro-batch.
cut-cross-entropy needs triton and Liger a GPU; this file is plain torch and runs wherever the model does.

**The z-loss** (``train.z_loss``): ``coef * logsumexp(logits)^2`` averaged over the target tokens, which pulls the
log-partition towards 0 so the logits cannot drift upwards together (PaLM's auxiliary loss). :func:`training_loss`
adds it to the training objective only; validation, perplexity and ``eval.py`` use :func:`causal_lm_loss`, the
language-model loss alone. The chunked path takes it, and its gradient, from each chunk's log-sum-exp, so no logits
are held for it either. Targets equal to :data:`IGNORE_INDEX` count in neither mean.

**An MoE model's router** (``model.num_experts`` > 0): its load-balancing loss, as the model class returns it
(``aux_loss``), times ``model.router_aux_loss_coef`` is a third term of the training objective, logged apart; the
tokens each expert received are counted from the experts the routers chose (``lmrecipe/model/routing.py``, the load
balance of a logged step and what auxiliary-loss-free balancing moves its bias by).

With document masking (``data.document_masking``), every forward also receives the keyword arguments that carry the
batch's document boundaries (``DocumentAttention.forward_kwargs``): position ids restarting at each document and
the mask or the variable-length offsets of the attention path.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator, NamedTuple

import torch
import torch.nn.functional as F

from lmrecipe.model.attention import DocumentAttention
from lmrecipe.model.routing import RouterLoads
from lmrecipe.data.batches import ValBatches
from lmrecipe.errors import fail

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100
"""A target that counts in no average (``F.cross_entropy``'s default): the z-loss skips the tokens the loss skips."""


def forward_kwargs(attention: DocumentAttention | None, documents, device: torch.device) -> dict:
    """The document keywords of one forward (none without document masking)."""
    if attention is None:
        return {}
    if documents is None:
        raise ValueError("document masking is on but the batch carries no document boundaries")
    return attention.forward_kwargs(documents, device)


def compute_dtype(weight: torch.Tensor, device_type: str) -> torch.dtype:
    """The dtype of the head's GEMMs: autocast's while it is on for ``device_type``, else the weight's."""
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return weight.dtype


_addmm_out_dtype = {"usable": torch.torch_version.TorchVersion(torch.__version__) >= "2.8"}
"""Whether ``torch.addmm(fp32, bf16, bf16, out_dtype=fp32, out=fp32)``, one GEMM that sums a bf16 product into fp32,
can be used: it exists from torch 2.8 on, on CUDA only (no CPU kernel in torch 2.13); a device or build that refuses
it turns it off for the process, and the sum falls back to a product then an add."""


def _add_weight_grad(grad_weight: torch.Tensor, grad_logits: torch.Tensor, hidden: torch.Tensor) -> None:
    """``grad_weight += grad_logits.T @ hidden``: the GEMM in the inputs' dtype, the sum in ``grad_weight``'s fp32.

    An explicit in-place GEMM, because autocast never casts an in-place op."""
    if grad_logits.dtype == grad_weight.dtype:
        grad_weight.addmm_(grad_logits.t(), hidden)
        return
    if _addmm_out_dtype["usable"] and grad_weight.is_cuda:
        try:
            torch.addmm(grad_weight, grad_logits.t(), hidden, out_dtype=torch.float32, out=grad_weight)
            return
        except (RuntimeError, TypeError) as err:  # refused before it wrote anything: the fallback below
            _addmm_out_dtype["usable"] = False
            logger.info("torch.addmm with out_dtype=float32 is not available here (%s); the chunked loss's weight "
                        "gradient is summed as a product then an add.", str(err)[:200])
    grad_weight.add_(grad_logits.t() @ hidden)  # a [vocab, dim] product in the inputs' dtype, summed in fp32


class ChunkedCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of ``hidden @ weight.T (+ bias)`` against ``targets``, ``chunk_tokens`` tokens at a time:
    the forward-only path of validation and ``eval.py`` (its backward recomputes each chunk's logits).

    ``hidden``: ``[tokens, dim]``; ``weight``: ``[vocab, dim]``; returns fp32 ``[tokens]`` losses, 0 where the target
    is :data:`IGNORE_INDEX`. The logits are computed in the compute dtype (:func:`compute_dtype`, recorded for the
    backward, which runs outside autocast) and upcast to fp32, as the full path does; the backward's three GEMMs run
    in that dtype too. ``max_abs_logit``: a 0-dim fp32 tensor that receives the largest absolute logit seen (None: not
    measured).
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_tokens: int, max_abs_logit: torch.Tensor | None = None):
        dtype = compute_dtype(weight, hidden.device.type)
        counted, safe_targets = _counted(targets)
        losses = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(losses)
        with torch.autocast(hidden.device.type, enabled=False):
            weight_c, bias_c = _cast(weight, dtype), _cast(bias, dtype)
            for start in range(0, hidden.shape[0], chunk_tokens):
                rows = slice(start, start + chunk_tokens)
                logits = _fp32(F.linear(hidden[rows].to(dtype), weight_c, bias_c))
                target_logit = logits.gather(1, safe_targets[rows, None]).squeeze(1)
                if max_abs_logit is not None:
                    torch.maximum(max_abs_logit, logits.abs().amax(), out=max_abs_logit)
                # log-sum-exp in place: one chunk of logits is the only chunk-sized tensor alive.
                top = logits.amax(dim=1, keepdim=True)
                lse[rows] = logits.sub_(top).exp_().sum(dim=1).log_().add_(top.squeeze(1))
                losses[rows] = (lse[rows] - target_logit).masked_fill_(~counted[rows], 0.0)
                del logits  # before the next chunk's logits exist
        ctx.save_for_backward(hidden, weight, bias, safe_targets, counted, lse)
        ctx.chunk_tokens, ctx.dtype = chunk_tokens, dtype
        ctx.set_materialize_grads(False)
        return losses

    @staticmethod
    def backward(ctx, grad_losses):
        hidden, weight, bias, safe_targets, counted, lse = ctx.saved_tensors
        if grad_losses is None:
            return None, None, None, None, None, None
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if bias is not None and ctx.needs_input_grad[2] else None
        grad_losses = grad_losses * counted  # an ignored target's loss is the constant 0
        weight_c, bias_c = _cast(weight, ctx.dtype), _cast(bias, ctx.dtype)
        for start in range(0, hidden.shape[0], ctx.chunk_tokens):
            rows = slice(start, start + ctx.chunk_tokens)
            # d loss / d logits = softmax - one_hot(target), times the incoming gradient of each token's loss.
            hidden_c = hidden[rows].to(ctx.dtype)
            grad_logits = _fp32(F.linear(hidden_c, weight_c, bias_c)).sub_(lse[rows, None]).exp_()
            grad_logits.scatter_add_(1, safe_targets[rows, None], grad_logits.new_full((grad_logits.shape[0], 1), -1.0))
            grad_logits.mul_(grad_losses[rows, None])
            if grad_bias is not None:
                grad_bias += grad_logits.sum(0)
            grad_logits = grad_logits.to(ctx.dtype)
            if grad_hidden is not None:
                grad_hidden[rows] = grad_logits @ weight_c
            if grad_weight is not None:
                _add_weight_grad(grad_weight, grad_logits, hidden_c)
            del grad_logits  # before the next chunk's logits exist
        grad_weight = None if grad_weight is None else grad_weight.to(weight.dtype)
        grad_bias = None if grad_bias is None else grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None


class ChunkedObjective(torch.autograd.Function):
    """The training objective of ``hidden @ weight.T (+ bias)`` against ``targets``, ``chunk_tokens`` tokens at a time,
    with its gradients formed in the forward.

    Returns three fp32 scalars: the objective (the only differentiable output), the mean language-model loss and the
    z term ``z_loss * mean(logsumexp^2)``, both over the targets that are not :data:`IGNORE_INDEX`; the objective is
    their sum. With ``form_grads`` each chunk's logits become their gradient in place once its losses are read, and that
    gradient becomes the hidden states' and the weight's: three GEMMs per chunk (logits, hidden, weight) in the compute
    dtype (:func:`compute_dtype`), the weight's summed in fp32. The backward only scales them by the incoming gradient,
    so no logits are recomputed (the per-token path's fourth GEMM). The gradients are kept unscaled by the token count
    until then, so fp16 does not underflow them.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_tokens: int, z_loss: float, form_grads: bool,
                max_abs_logit: torch.Tensor | None = None):
        dtype = compute_dtype(weight, hidden.device.type)
        counted, safe_targets = _counted(targets)
        tokens = counted.sum().clamp_min(1)
        losses = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(losses)
        needs = [form_grads and need for need in ctx.needs_input_grad[:3]]
        grad_hidden = torch.empty_like(hidden) if needs[0] else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if needs[1] else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if bias is not None and needs[2] else None
        with torch.autocast(hidden.device.type, enabled=False):
            weight_c, bias_c = _cast(weight, dtype), _cast(bias, dtype)
            for start in range(0, hidden.shape[0], chunk_tokens):
                rows = slice(start, start + chunk_tokens)
                hidden_c = hidden[rows].to(dtype)
                chunk = _fp32(F.linear(hidden_c, weight_c, bias_c))  # the chunk's logits, then their gradient
                target_logit = chunk.gather(1, safe_targets[rows, None]).squeeze(1)
                if max_abs_logit is not None:
                    torch.maximum(max_abs_logit, chunk.abs().amax(), out=max_abs_logit)
                top = chunk.amax(dim=1, keepdim=True)
                sum_exp = chunk.sub_(top).exp_().sum(dim=1)  # in place: the only chunk-sized fp32 tensor
                lse[rows] = sum_exp.log().add_(top.squeeze(1))
                losses[rows] = lse[rows] - target_logit
                if any(needs):
                    # d objective / d logits, times the token count: counted * (softmax * (1 + 2 z lse) - one_hot).
                    weight_of_row = counted[rows].float()
                    chunk.mul_((weight_of_row * (1 + 2 * z_loss * lse[rows]) / sum_exp)[:, None])
                    chunk.scatter_add_(1, safe_targets[rows, None], -weight_of_row[:, None])
                    if grad_bias is not None:
                        grad_bias += chunk.sum(0)
                    chunk = chunk.to(dtype)  # frees the fp32 chunk before the GEMMs
                    if grad_hidden is not None:
                        grad_hidden[rows] = chunk @ weight_c
                    if grad_weight is not None:
                        _add_weight_grad(grad_weight, chunk, hidden_c)
                del chunk  # before the next chunk's logits exist
        lm = torch.where(counted, losses, 0.0).sum() / tokens
        z = z_loss * torch.where(counted, lse.square(), 0.0).sum() / tokens
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias, tokens)
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.mark_non_differentiable(lm, z)
        ctx.set_materialize_grads(False)
        return lm + z, lm, z

    @staticmethod
    def backward(ctx, grad_objective, _grad_lm, _grad_z):
        grad_hidden, grad_weight, grad_bias, tokens = ctx.saved_tensors
        if grad_objective is None:
            return (None,) * 8
        scale = grad_objective / tokens
        hidden_dtype, weight_dtype, bias_dtype = ctx.dtypes
        return (_scaled(grad_hidden, scale, hidden_dtype), _scaled(grad_weight, scale, weight_dtype),
                _scaled(grad_bias, scale, bias_dtype), None, None, None, None, None)


def _counted(targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(targets that count, targets with the ignored ones replaced by 0 so they can index a gather)."""
    counted = targets != IGNORE_INDEX
    return counted, targets.masked_fill(~counted, 0)


def _cast(tensor: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if tensor is None else tensor.to(dtype)


def _fp32(logits: torch.Tensor) -> torch.Tensor:
    """fp32 logits that may be written in place: a copy of lower-precision ones, fp32 ones as they are (fresh)."""
    return logits if logits.dtype == torch.float32 else logits.float()


def _scaled(grad: torch.Tensor | None, scale: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor | None:
    """``grad * scale`` in fp32 (in place when ``grad`` is fp32: it is used once), then in ``dtype``."""
    if grad is None:
        return None
    return (grad.mul_(scale) if grad.dtype == torch.float32 else grad.float().mul_(scale)).to(dtype)


class ChunkedLossHead(torch.nn.Module):
    """The model's output layer, returning losses instead of logits while targets are set, and ordinary logits
    otherwise (generation, a forward without targets).

    Holds the original layer's parameters themselves (``weight``, ``bias``), so names, ties to the input embedding,
    ZeRO-3 partitions and checkpoints are unchanged. Under :meth:`targets_set` the output is each token's loss
    (:class:`ChunkedCrossEntropy`: validation, ``eval.py``); under :meth:`objective_set` it is ``[3]``: the training
    objective, the mean language-model loss and the z term (:class:`ChunkedObjective`, gradients formed in the
    forward). While :attr:`max_abs_logit` is a tensor, every forward with targets raises it to the largest absolute
    logit it computes (the per-layer instruments' figure; the logits are never whole).
    """

    def __init__(self, head: torch.nn.Linear, chunk_tokens: int):
        super().__init__()
        self.weight = head.weight
        self.bias = head.bias
        self.chunk_tokens = chunk_tokens
        self.targets: torch.Tensor | None = None
        self.z_loss: float | None = None
        """Set (:meth:`objective_set`): the forward returns the training objective's terms; None: per-token losses."""
        self.max_abs_logit: torch.Tensor | None = None

    @contextlib.contextmanager
    def targets_set(self, targets: torch.Tensor) -> Iterator[None]:
        """Forwards in this context return each token's loss against ``targets``."""
        self.targets = targets
        try:
            yield
        finally:
            self.targets = None

    @contextlib.contextmanager
    def objective_set(self, targets: torch.Tensor, z_loss: float = 0.0) -> Iterator[None]:
        """Forwards in this context return ``[objective, lm, z]`` against ``targets`` (:class:`ChunkedObjective`)."""
        self.targets, self.z_loss = targets, z_loss
        try:
            yield
        finally:
            self.targets, self.z_loss = None, None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.targets is None:
            return F.linear(hidden, self.weight, self.bias)
        if hidden.shape[:-1] != self.targets.shape:
            raise ValueError(f"chunked loss: hidden states {tuple(hidden.shape)} do not match the targets "
                             f"{tuple(self.targets.shape)}")
        flat_hidden, flat_targets = hidden.flatten(0, -2), self.targets.flatten()
        if self.z_loss is not None:
            terms = ChunkedObjective.apply(flat_hidden, self.weight, self.bias, flat_targets, self.chunk_tokens,
                                           self.z_loss, torch.is_grad_enabled(), self.max_abs_logit)
            return torch.stack(terms)
        losses = ChunkedCrossEntropy.apply(flat_hidden, self.weight, self.bias, flat_targets, self.chunk_tokens,
                                           self.max_abs_logit)
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
        if reduction != "mean":
            return per_token
        return per_token.sum() / (targets != IGNORE_INDEX).sum().clamp_min(1)  # F.cross_entropy's mean
    logits = model(input_ids=inputs, **(model_kwargs or {})).logits
    loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction=reduction)
    return loss if reduction == "mean" else loss.view(targets.shape)


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
    head: torch.Tensor | None = None
    """The chunked loss head's ``lm + z``, the one of them that carries their gradient (:class:`ChunkedObjective`):
    ``lm`` and ``z`` are then detached figures. None: ``lm`` and ``z`` carry their own gradients."""

    def objective(self) -> torch.Tensor:
        """The sum that is backpropagated: the language-model loss and the terms that are on."""
        total, terms = (self.lm, (self.z, self.aux)) if self.head is None else (self.head, (self.aux,))
        for term in terms:
            if term is not None:
                total = total + term
        return total


def training_loss(model, inputs: torch.Tensor, targets: torch.Tensor, z_loss: float = 0.0,
                  model_kwargs: dict | None = None, aux_loss_coef: float = 0.0,
                  router_loads: RouterLoads | None = None) -> LossTerms:
    """The training objective's terms: the mean language-model loss (:func:`causal_lm_loss`'s), the z-loss
    ``z_loss * mean(logsumexp(logits)^2)`` over the same target tokens (None when ``z_loss`` is 0), and an MoE model's
    router load-balancing loss times ``aux_loss_coef`` (None when 0 or when the model returns none). The caller
    backpropagates their sum (:meth:`LossTerms.objective`) and logs them apart. ``router_loads`` (an MoE model's
    routers, ``lmrecipe/model/routing.py``): the tokens each expert received in this forward, as its routers chose
    them, are counted too (:attr:`LossTerms.expert_tokens`). With a :class:`ChunkedLossHead`
    the head returns the reduced terms and has already formed their gradients (:attr:`LossTerms.head`).
    """
    head = chunked_head(model)
    head_objective = None
    with router_loads.recording() if router_loads is not None else contextlib.nullcontext() as chosen:
        with head.objective_set(targets, z_loss) if head is not None else contextlib.nullcontext():
            outputs = model(input_ids=inputs, **(model_kwargs or {}))
    if head is not None:
        head_objective, lm_loss, z_term = outputs.logits.unbind()
        lm_loss, z_term = lm_loss.detach(), z_term.detach() if z_loss != 0 else None
    else:
        logits = outputs.logits.float()
        lm_loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        z_term = None
        if z_loss != 0:
            counted = targets != IGNORE_INDEX
            lse = torch.logsumexp(logits, dim=-1)
            z_term = z_loss * (lse.square() * counted).sum() / counted.sum().clamp_min(1)
    aux = getattr(outputs, "aux_loss", None)
    aux_term = aux_loss_coef * aux if aux_loss_coef and isinstance(aux, torch.Tensor) else None
    counts = RouterLoads.stacked(chosen) if router_loads is not None else None
    return LossTerms(lm_loss, z_term, aux_term, counts, head_objective)


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
