"""``model.router_bias_update_rate``: auxiliary-loss-free load balancing, DeepSeek-V3's rule applied after every
optimizer step (``lmrecipe/model/routing.py``).

At ``after_step`` (the update is done) the step's expert loads, which every rank counted from its own tokens as its
routers chose them, are summed over the ranks on the device (one all-reduce, no host read), so every rank moves its
copy of each layer's bias by the same ``rate * sign(mean - load)``: the replicas stay identical without a broadcast. A
step whose update was skipped (a non-finite gradient) leaves the bias too. The bias is a buffer of the model, so the
checkpoint saves it with the weights (and the export holds it). The callback also keeps each layer's bias in
``train_state.json`` (its state, exact: fp32 values as JSON doubles) and writes it back after the weights are loaded:
a resume onto another layout loads the weights from the topology-free form, which holds parameters only
(``lmrecipe/checkpoint/portable.py``), and would start from the built model's bias instead.
"""

from __future__ import annotations

import logging

import torch

from lmrecipe.errors import fail
from lmrecipe.model.routing import keep_biases_fp32, routing_biases, update_routing_biases_
from lmrecipe.train.callback import Callback

logger = logging.getLogger(__name__)


class RoutingBiasUpdate(Callback):
    """Moves every MoE layer's routing bias toward balance after each optimizer step."""

    name = "routing_bias"

    def __init__(self, rate: float):
        self.rate = rate
        self.biases = []

    def attach(self, trainer) -> None:
        run = trainer.run
        self.accelerator = run.accelerator
        keep_biases_fp32(run.model)
        try:
            self.biases = routing_biases(run.model)
        except ValueError as err:
            raise fail(f"model.router_bias_update_rate={self.rate}: {err}; the bias cannot be updated layer by layer. "
                       "Set model.router_bias_update_rate=0.") from None
        if not self.biases or run.router_loads is None:
            raise fail(f"model.router_bias_update_rate={self.rate} moves the routers' routing bias "
                       "(e_score_correction_bias), and this model's routers have none (a dense model, or an MoE "
                       "class that routes without one). Set model.router_bias_update_rate=0, or train "
                       "model.arch=deepseek_v3 with routed experts.")
        logger.info("Routing bias: %d MoE layers' biases move by %g per step toward balance", len(self.biases),
                    self.rate)

    def after_step(self, trainer, result) -> None:
        if result.expert_tokens is None:
            return
        tokens = self.accelerator.reduce(result.expert_tokens, reduction="sum")
        update_routing_biases_(self.biases, tokens, self.rate, result.skipped)

    def state_dict(self) -> dict:
        return {"biases": [bias.tolist() for bias in self.biases]}  # at a save point: a host read there anyway

    def load_state_dict(self, state: dict | None) -> None:
        saved = (state or {}).get("biases")
        if saved is None:
            return  # a checkpoint of a run without the update: the bias the weights hold
        if [len(b) for b in saved] != [b.numel() for b in self.biases]:
            raise fail(f"The checkpoint's routing biases ({len(saved)} layers of {len(saved[0]) if saved else 0} "
                       f"experts) do not fit this model's ({len(self.biases)} layers of "
                       f"{self.biases[0].numel() if self.biases else 0}): it was written by another model shape.")
        with torch.no_grad():
            for bias, values in zip(self.biases, saved):
                bias.copy_(torch.tensor(values, dtype=torch.float32))
