"""The training objective and the validation loss, shared by the training loop and ``eval.py``.

With document masking (``data.document_masking``), every forward also receives the keyword arguments that carry the
batch's document boundaries (``DocumentAttention.forward_kwargs``): position ids restarting at each document and
the mask or the variable-length offsets of the attention path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lmrecipe.attention import DocumentAttention
from lmrecipe.data.batches import ValBatches


def forward_kwargs(attention: DocumentAttention | None, documents, device: torch.device) -> dict:
    """The document keywords of one forward (none without document masking)."""
    if attention is None:
        return {}
    if documents is None:
        raise ValueError("document masking is on but the batch carries no document boundaries")
    return attention.forward_kwargs(documents, device)


def causal_lm_loss(model, inputs: torch.Tensor, targets: torch.Tensor, reduction: str = "mean",
                   model_kwargs: dict | None = None) -> torch.Tensor:
    """Next-token cross-entropy in fp32 (targets are the inputs shifted by one, so no token is dropped).

    ``model_kwargs``: further keyword arguments of the forward (the document boundaries, :func:`forward_kwargs`).
    """
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
