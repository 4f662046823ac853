"""Resuming on another number of processes or another ZeRO stage: exact losses and exact optimizer state.

Each case resumes step HALF of an uninterrupted run on a new layout (same recipe, same global batch) and
compares the losses of the steps after the resume with the uninterrupted run's; the probes load the checkpoint
the way training does and read the AdamW moments back through the optimizer, against the saved ones read
directly from the source files.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from helpers import (
    layout,
)

from lmrecipe.parallel.topology import Topology
from lmrecipe.optim import optimizer_param_names


def needs_conversion(saved: Topology, current: Topology) -> bool:
    return current.needs_conversion_from(saved)


def layout_changes(saved: Topology, current: Topology) -> list[str]:
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
    assert Topology.from_record({"world_size": 1, "deepspeed": True, "zero_stage": 1}) == layout(1, 1)
    assert Topology.from_record(layout(2, 3, offload=True).record()) == layout(2, 3, offload=True)


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


# ---------------------------------------------------------------------------------------------- the portable form


def plain_checkpoint(folder: Path):
    """A checkpoint as Accelerate writes one without DeepSpeed (model.safetensors + optimizer.bin) after one AdamW
    step of a small untied Llama; returns the model and the optimizer."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from lmrecipe.optim import split_params

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, tie_word_embeddings=False))
    decay, no_decay = split_params(model, decay_embeddings=False)
    optimizer = torch.optim.AdamW([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}])
    model(input_ids=torch.randint(0, 96, (2, 8)), labels=torch.randint(0, 96, (2, 8))).loss.backward()
    optimizer.step()
    folder.mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, folder / "model.safetensors")
    torch.save(optimizer.state_dict(), folder / "optimizer.bin")
    return model, optimizer


def test_every_rank_streams_its_share_of_the_portable_form_into_bounded_files(tmp_path):
    import json

    import torch
    from safetensors.torch import load_file

    from lmrecipe.checkpoint.portable import (
        STATES,
        PortableState,
        cached_portable,
        finish,
        plan_shards,
        write_share,
    )
    from lmrecipe.checkpoint.readers import open_source

    model, optimizer = plain_checkpoint(tmp_path / "step")
    source = open_source(tmp_path / "step", deepspeed_dir=None,
                         param_names=optimizer_param_names(model, decay_embeddings=False))
    max_bytes = 20_000  # the embeddings (12 KB each) share no file; the layers' matrices fill several
    plan = plan_shards(source.shapes, 2, max_bytes)
    out = tmp_path / "portable"
    out.mkdir()
    written = {rank: write_share(source, plan, out, rank) for rank in (0, 1)}  # as two ranks do, one after the other
    finish(out, plan, source.steps, source_layout=layout(1, None), source_sha256="f" * 64)
    # Both ranks wrote, about half the bytes each, each file at most max_bytes; every parameter is in one file.
    assert min(written.values()) > 0.3 * sum(written.values())
    assert sorted(i for rank in (0, 1) for i in plan.files_of(rank)) == list(range(len(plan.files))) and len(plan.files) > 2
    files = sorted(out.glob("*.safetensors"))
    assert len(files) == len(STATES) * len(plan.files)
    assert all(f.stat().st_size <= max_bytes + 1024 for f in files)  # + the header
    states = {"fp32": dict(model.named_parameters())}
    for key in ("exp_avg", "exp_avg_sq"):
        states[key] = {name: optimizer.state[p][key] for name, p in model.named_parameters()}
    for key in STATES:
        weight_map = json.loads((out / f"{key}.safetensors.index.json").read_text())["weight_map"]
        assert set(weight_map) == set(states["fp32"])
        tensors = {name: t for file in set(weight_map.values()) for name, t in load_file(out / file).items()}
        assert set(tensors) == set(weight_map)  # what safetensors itself reads back
        assert all(torch.equal(tensors[name], states[key][name].detach()) for name in tensors)
    assert cached_portable(out, "f" * 64) and not cached_portable(out, "0" * 64)
    # A rank reads only the rows holding its fragment of a flattened tensor.
    name = "model.layers.1.mlp.up_proj.weight"
    portable = PortableState(out)
    assert torch.equal(portable.get_flat("exp_avg", name, 37, 100), states["exp_avg"][name].reshape(-1)[37:137])
    assert portable.step(name) == 1


def test_a_cache_in_the_earlier_one_file_per_state_form_is_converted_again(tmp_path):
    import json

    import torch
    from safetensors.torch import save_file

    from lmrecipe.checkpoint.portable import cached_portable, stale_form

    old = tmp_path / "step_00000003.portable"
    old.mkdir()
    for key in ("fp32", "exp_avg", "exp_avg_sq"):
        save_file({"w": torch.zeros(2)}, old / f"{key}.safetensors")
    (old / "portable.json").write_text(json.dumps({"format_version": 1, "source_state_sha256": "a" * 64,
                                                   "params": {"w": [2]}, "step": {"w": 3}}))
    assert stale_form(old) and not cached_portable(old, "a" * 64)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="resident file pages are read from /proc (Linux)")
def test_pages_of_a_memory_mapped_shard_leave_the_resident_set_once_read(tmp_path):
    import torch

    from lmrecipe.checkpoint.readers import _load_mapped, _PageRelease

    def resident_file_mb() -> float:
        status = Path("/proc/self/status").read_text()
        return int(next(line.split()[1] for line in status.splitlines() if line.startswith("RssFile:"))) / 1024

    torch.save({"flat": torch.ones(16 << 20 >> 2)}, tmp_path / "shard.pt")  # 16 MiB
    flat = _load_mapped(tmp_path / "shard.pt", weights_only=True)["flat"]
    release = _PageRelease([tmp_path / "shard.pt"])
    before = resident_file_mb()
    assert float(flat.sum()) == flat.numel()  # every page read
    read = resident_file_mb()
    release(flat)
    assert read - before > 12 and resident_file_mb() - before < 2
    assert float(flat.sum()) == flat.numel()  # still readable: the pages come back from the file


def test_a_range_across_partitions_is_copied_chunk_by_chunk_exactly(monkeypatch):
    import torch

    from lmrecipe.checkpoint import readers
    from lmrecipe.errors import UserError

    monkeypatch.setattr(readers, "_CHUNK_VALUES", 3)
    pieces = [torch.arange(0.0, 7.0), torch.arange(7.0, 9.0), torch.arange(9.0, 20.0)]  # ranks' partitions
    released = []
    out = torch.empty(12)
    readers._copy_range(pieces, 5, out, released.append)
    assert torch.equal(out, torch.arange(5.0, 17.0))
    assert max(t.numel() for t in released) <= 3 and sum(t.numel() for t in released) == 12
    with pytest.raises(UserError, match="incomplete"):
        readers._copy_range(pieces, 15, torch.empty(6), released.append)  # past the end of the shards
