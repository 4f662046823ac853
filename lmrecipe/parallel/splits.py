"""What the sequence, tensor and expert splits need of the model and do to it: Ulysses' share of each sequence
(:class:`SequenceParallel`) and its attention, the checks of a built model's heads and matrices, and the one place
AutoEP and transformers are made to agree."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from lmrecipe.errors import fail


@dataclass(frozen=True)
class SequenceParallel:
    """Ulysses sequence parallelism: ranks ``[g * size, (g + 1) * size)`` form group g (DeepSpeed's grouping) and
    share each of its sequences; group rank ``rank`` holds tokens ``[rank * L, (rank + 1) * L)``, ``L = seq_len /
    size``. Inside attention DeepSpeed's all-to-alls trade the sequence split for a head split, so every rank attends
    over the whole sequence for ``heads / size`` heads; elsewhere a rank computes only its own tokens.

    Each rank backpropagates its own tokens' mean loss divided by ``loss_divisor``, so the reduced gradient is the
    gradient of the windows' mean loss, as without sequence parallelism (every rank holds an equal number of
    tokens: ``seq_len`` divides evenly and every token has a target). DeepSpeed 0.19.8 reduces differently by path:
    ZeRO-1/2 (and ZeRO-3 with ``"reduce_scatter": false``) sum a group's gradients and average over the
    data-parallel ranks (divisor = size); ZeRO-3's default reduce-scatter averages over every rank (divisor 1).
    The multi-process tests compare gradient norms with and without sequence parallelism for each stage. The logged
    loss is the mean over ranks of their tokens' means: the same figure as without.
    """

    size: int
    rank: int
    loss_divisor: int = 1

    @classmethod
    def of_rank(cls, size: int, rank: int, ds_config: dict) -> "SequenceParallel":
        zero = ds_config.get("zero_optimization", {})
        averages_over_all = int(zero.get("stage", 0)) == 3 and zero.get("reduce_scatter", True)
        return cls(size, rank % size, 1 if averages_over_all else size)

    def shard(self, inputs: torch.Tensor, targets: torch.Tensor, model_kwargs: dict, device) -> tuple:
        """This rank's tokens of a micro-batch and the forward keywords for them: its slice of ``position_ids``
        (whole-window positions otherwise; DeepSpeed all-gathers them in every attention layer); the document
        keywords of document masking stay whole, as they describe the sequence the attention sees."""
        seq_len = inputs.shape[1]
        local = slice(self.rank * seq_len // self.size, (self.rank + 1) * seq_len // self.size)
        kwargs = dict(model_kwargs)
        positions = kwargs.get("position_ids")
        if positions is None:
            positions = torch.arange(local.start, local.stop, device=device).expand(inputs.shape[0], -1)
        else:
            positions = positions[:, local]
        kwargs["position_ids"] = positions
        return inputs[:, local], targets[:, local], kwargs


def check_sequence_parallel_model(sp: int, hf_config) -> None:
    """What ``distributed.sequence_parallel_size`` (``sp``) needs of the built model's config (exit 2 naming the fix).
    The rules ``sequence_parallel_*`` refuse a recipe's own shape, windows and attention at load; this check covers a
    model continued from ``model.init_from``, whose heads are its checkpoint's."""
    if sp == 1:
        return
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    if heads % sp or (kv_heads % sp and sp % kv_heads):
        raise fail(f"""
            distributed.sequence_parallel_size={sp} must divide the attention heads (model.num_heads={heads}) and
            divide or be a multiple of the key/value heads ({kv_heads}): the all-to-all splits heads over the group.
            Choose a sequence_parallel_size that does.""")


def check_tensor_parallel_model(tp: int, hf_config) -> None:
    """What ``distributed.tensor_parallel_size`` (``tp``) needs of the built model's config: every split matrix divides
    evenly. The rule ``tensor_parallel_divides_model`` refuses a recipe's own shape at load; this check covers a model
    continued from ``model.init_from``, whose shape is its checkpoint's."""
    if tp == 1:
        return
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    intermediate = hf_config.intermediate_size
    if heads % tp or kv_heads % tp or intermediate % tp:
        raise fail(f"""
            distributed.tensor_parallel_size={tp} must divide the attention heads (model.num_heads={heads}), the
            key/value heads ({kv_heads}) and model.intermediate_size={intermediate}: each rank holds an equal share
            of every split matrix. Choose a tensor_parallel_size that divides all three.""")


def _sequence_parallelism(sp: int, world_size: int, seq_len: int):
    """Accelerate's ParallelismConfig for DeepSpeed Ulysses; the attention it wraps is named before ``prepare``
    (:func:`name_sequence_parallel_attention`)."""
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig

    handler = DeepSpeedSequenceParallelConfig(sp_seq_length=seq_len, sp_seq_length_is_variable=False,
                                              sp_attn_implementation="sdpa")
    # dp_replicate_size: Accelerate sizes DeepSpeed's train_batch_size from it under SP.
    return ParallelismConfig(sp_backend="deepspeed", sp_size=sp, sp_handler=handler,
                             dp_replicate_size=world_size // sp)


def name_sequence_parallel_attention(accelerator, model) -> None:
    """Tell Accelerate which attention function Ulysses wraps: the one the model was built with. The recipe's
    attention functions are registered in transformers' ``AttentionInterface`` under their own names (no mask
    builder, no host sync), which Accelerate's up-front check of builtin names does not know; DeepSpeed accepts
    any registered name that matches the model's. With fewer key/value heads than ranks, evaluation forwards are
    kept on the model's own head count (:func:`_keep_key_value_groups`)."""
    config = getattr(accelerator, "parallelism_config", None)
    if config is not None and config.sp_size > 1:
        config.sp_handler.sp_attn_implementation = model.config._attn_implementation
        kv_heads = getattr(model.config, "num_key_value_heads", None) or model.config.num_attention_heads
        if kv_heads < config.sp_size:
            _keep_key_value_groups(model)


def _keep_key_value_groups(model) -> None:
    """With fewer key/value heads than ranks, Ulysses replicates them and overwrites each attention module's
    ``num_key_value_groups`` (query heads per key/value head) with its per-rank value during a training forward, and
    never restores it. An evaluation forward (the validation loss, the checkpoint's probe) runs the attention
    unsplit, on every head, so it would repeat the key/value heads too few times (a shape error in the first
    validation or checkpoint): each attention module gets its own count back before every forward (the Ulysses
    path sets its own again inside)."""
    for module in model.modules():
        groups = getattr(module, "num_key_value_groups", None)
        if isinstance(groups, int):
            module.register_forward_pre_hook(lambda m, args, groups=groups: setattr(m, "num_key_value_groups", groups))


@contextlib.contextmanager
def autoep_registry_compat():
    """Where this recipe works around DeepSpeed 0.19.8 AutoEP and transformers 5.23 disagreeing, and only there.

    AutoEP re-points the models' router-logit recorders through transformers' ``_CAN_RECORD_REGISTRY``, calling
    ``registry.get(class_name, default)`` on it as on a plain dict; transformers 5.23 changed that method to
    ``get(model)`` (keyed by a model's class), so the call fails with "_CanRecordRegistry.get() takes 2 positional
    arguments" (and a class name alone would find nothing). While the engine is built, the method also takes a class
    name and a default, as a dict's does. ``tests/unit/test_moe.py`` fails once transformers or DeepSpeed no longer
    disagree, so that this can go.
    """
    from transformers.utils.output_capturing import _CanRecordRegistry

    original = _CanRecordRegistry.get

    def get(registry, key, *default):
        if isinstance(key, str):
            return dict.get(registry, key, *default)
        return original(registry, key)

    _CanRecordRegistry.get = get
    try:
        yield
    finally:
        _CanRecordRegistry.get = original
