"""The training objective and the validation loss, shared by the training loop and ``eval.py``."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lmrecipe.data.batches import ValBatches


def causal_lm_loss(model, inputs: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Next-token cross-entropy in fp32 (targets are the inputs shifted by one, so no token is dropped)."""
    logits = model(input_ids=inputs).logits
    loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction=reduction)
    return loss if reduction == "mean" else loss.view(targets.shape)


@torch.no_grad()
def validation_loss(model, val_batches: ValBatches, accelerator) -> float:
    """Mean validation loss over the fixed windows, identical for any split over ranks (one all-reduce)."""
    was_training = model.training
    model.eval()
    device = accelerator.device
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for inputs, targets, valid in val_batches:
        per_token = causal_lm_loss(model, inputs.to(device), targets.to(device), "none")
        total[0] += (per_token.sum(dim=1).double() * valid.to(device)).sum()
        total[1] += valid.sum() * targets.shape[1]
    total = accelerator.reduce(total, reduction="sum")
    model.train(was_training)
    return (total[0] / total[1]).item()
