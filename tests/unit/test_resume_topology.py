"""Resuming on another number of processes or another ZeRO stage: exact losses and exact optimizer state.

Each case resumes step HALF of an uninterrupted run on a new layout (same recipe, same global batch) and
compares the losses of the steps after the resume with the uninterrupted run's; the probes load the checkpoint
the way training does and read the AdamW moments back through the optimizer, against the saved ones read
directly from the source files.
"""

from __future__ import annotations

from helpers import (
    layout,
)

from lmrecipe.distributed import Layout
from lmrecipe.optim import optimizer_param_names


def needs_conversion(saved: Layout, current: Layout) -> bool:
    return current.needs_conversion_from(saved)


def layout_changes(saved: Layout, current: Layout) -> list[str]:
    return current.changes_from(saved)


def test_which_layout_changes_need_a_conversion():
    assert not needs_conversion(layout(2, None), layout(4, None))  # DDP state is whole on every rank
    assert layout_changes(layout(2, None), layout(4, None)) == ["processes 2 -> 4"]
    assert not needs_conversion(layout(2, 2), layout(2, 2)) and layout_changes(layout(2, 2), layout(2, 2)) == []
    assert needs_conversion(layout(2, 2), layout(1, 2))
    assert layout_changes(layout(2, 2), layout(2, 3)) == ["ZeRO-2 -> ZeRO-3"]
    assert layout_changes(layout(2, 3), layout(1, None)) == ["processes 2 -> 1", "ZeRO-3 -> no DeepSpeed"]
    assert layout_changes(layout(2, 2), layout(2, 2, offload=True)) == ["ZeRO-2 -> ZeRO-2 (offload optimizer)"]
    # Checkpoints written before offload was recorded read as "no offload".
    assert Layout.from_topology({"world_size": 1, "deepspeed": True, "zero_stage": 1}) == layout(1, 1)
    assert Layout.from_topology(layout(2, 3, offload=True).to_dict()) == layout(2, 3, offload=True)


def test_optimizer_names_follow_the_optimizer_groups():
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, tie_word_embeddings=True))
    names = optimizer_param_names(model, decay_embeddings=False)
    flat = [n for group in names for n in group]
    assert len(names) == len(list(model.parameters()))
    assert ("model.embed_tokens.weight", "lm_head.weight") in names  # a tied weight goes by both names
    assert flat.index("model.layers.0.self_attn.q_proj.weight") < flat.index("model.embed_tokens.weight")
    assert flat.index("model.embed_tokens.weight") < flat.index("model.norm.weight")  # not decayed: second group
    with_decay = optimizer_param_names(model, decay_embeddings=True)
    assert with_decay.index(("model.embed_tokens.weight", "lm_head.weight")) < with_decay.index(("model.norm.weight",))
