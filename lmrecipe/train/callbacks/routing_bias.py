"""``model.router_bias_update_rate``: auxiliary-loss-free load balancing, DeepSeek-V3's rule applied after every
optimizer step (``lmrecipe/model/routing.py``).

At ``after_step`` (the update is done) the step's expert loads, which every rank counted from its own tokens as its
routers chose them, are summed over the ranks on the device (one all-reduce, no host read), so every rank moves its
copy of each layer's bias by the same ``rate * sign(mean - load)``: the replicas stay identical without a broadcast. A
step whose update was skipped (a non-finite gradient) leaves the bias too. The bias is a buffer of the model, so the
checkpoint saves it with the weights and a resume or a rollback restores it; the callback itself keeps no state.
"""

from __future__ import annotations

import logging

from lmrecipe.errors import fail
from lmrecipe.model.routing import keep_biases_fp32, routing_biases, update_routing_biases_
from lmrecipe.train.callback import Callback

logger = logging.getLogger(__name__)


class RoutingBiasUpdate(Callback):
    """Moves every MoE layer's routing bias toward balance after each optimizer step."""

    def __init__(self, rate: float):
        self.rate = rate

    def attach(self, trainer) -> None:
        run = trainer.run
        self.accelerator = run.accelerator
        keep_biases_fp32(run.model)
        try:
            self.biases = routing_biases(run.model)
        except ValueError as err:
            raise fail(f"model.router_bias_update_rate={self.rate}: {err}; the bias cannot be updated layer by layer. "
                       "Set model.router_bias_update_rate=0.") from None
        if not self.biases:
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
