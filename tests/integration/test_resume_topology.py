"""Resuming on another number of processes or another ZeRO stage: exact losses and exact optimizer state.

Each case resumes step HALF of an uninterrupted run on a new layout (same recipe, same global batch) and
compares the losses of the steps after the resume with the uninterrupted run's; the probes load the checkpoint
the way training does and read the AdamW moments back through the optimizer, against the saved ones read
directly from the source files.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import (
    HALF,
    LOSS_TOL,
    ROOT,
    STEPS,
    TINY_OVERRIDES,
    cached_run,
    layout,
    losses,
    max_loss_diff,
    run_script,
    run_train,
    tree_digest,
    zero_pair,
)
from safetensors.torch import load_file

from lmrecipe.checkpoint.portable import (
    cached_portable,
    convert,
    portable_dir,
    state_sha256,
)
from lmrecipe.checkpoint.storage import DS_TAG, STATE_FILE, read_checkpoint, step_dir_name
from lmrecipe.optim import optimizer_param_names

PARAM = "model.layers.0.mlp.gate_proj.weight"
ZERO = {stage: f"distributed.deepspeed_config=ds_configs/zero{stage}.json" for stage in (1, 2, 3)}


# ---------------------------------------------------------------------------------------------- real runs


def plain_source(tmp_path_factory, data: Path) -> Path:
    """1 process, no DeepSpeed, STEPS steps saving every HALF: the source of the none -> ZeRO-1 case."""
    out, _ = cached_run(tmp_path_factory, "plain_half", data, [f"train.max_steps={STEPS}", f"checkpoint.every_steps={HALF}"])
    return out


@pytest.fixture(scope="module")
def sources(tmp_path_factory, tiny_data) -> dict:
    """The uninterrupted runs whose step-HALF checkpoints are resumed, with each checkpoint's digest before any."""
    runs = {"zero2": zero_pair(tmp_path_factory, tiny_data, 2)["a"], "zero3": zero_pair(tmp_path_factory, tiny_data, 3)["a"],
            "plain": plain_source(tmp_path_factory, tiny_data)}
    out = {}
    for name, run in runs.items():
        ckpt = run / "checkpoints" / step_dir_name(HALF)
        digest_file = run.parent / f"{run.name}_half_digest.json"
        if not digest_file.is_file():
            digest_file.write_text(json.dumps(tree_digest(ckpt)))
        out[name] = {"run": run, "checkpoint": ckpt, "digest": json.loads(digest_file.read_text())}
    return out


CASES = {
    # name: (source, processes, overrides of the resumed run, what the log must say changed)
    "zero2-2p-to-zero2-1p": ("zero2", 1, [ZERO[2]], "processes 2 -> 1"),
    "zero2-to-zero3": ("zero2", 2, [ZERO[3]], "ZeRO-2 -> ZeRO-3"),
    "zero3-2p-to-none-1p": ("zero3", 1, ["model.tie_embeddings=true"], "processes 2 -> 1; ZeRO-3 -> no DeepSpeed"),
    "none-1p-to-zero1-2p": ("plain", 2, [ZERO[1]], "processes 1 -> 2; no DeepSpeed -> ZeRO-1"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_resume_on_another_layout_continues_the_losses_exactly(tmp_path, tiny_data, sources, case):
    source_name, nproc, overrides, change = CASES[case]
    source = sources[source_name]
    out = tmp_path / "run"
    leftover = out / "checkpoints" / f"{step_dir_name(HALF)}.portable.tmp-99999"  # a conversion killed midway
    leftover.mkdir(parents=True)
    proc = run_train(out, tiny_data, [f"train.max_steps={STEPS}", f"checkpoint.every_steps={HALF}",
                                      f"checkpoint.resume={source['checkpoint']}", *overrides], nproc=nproc)
    if change.endswith("-> no DeepSpeed"):  # DeepSpeed dropped: a WARNING naming the key
        assert f"on a new layout ({change}): the checkpoint's run trained with distributed.deepspeed_config=" in proc.stderr
    else:
        assert f"on a new layout: {change}." in proc.stderr
    assert not leftover.exists()
    resumed = losses(out)
    assert [step for step, _ in resumed] == list(range(HALF + 1, STEPS + 1))
    diff = max_loss_diff(resumed, losses(source["run"]))
    print(f"{case}: max |loss difference| after resume = {diff:.3g}")
    assert diff <= LOSS_TOL
    # The checkpoint was not modified; its topology-free form is cached beside it, and the new run's own
    # checkpoints record the new layout.
    assert tree_digest(source["checkpoint"]) == source["digest"]
    assert (portable_dir(source["checkpoint"]) / "portable.json").is_file()
    saved = read_checkpoint(out / "checkpoints" / step_dir_name(STEPS))
    assert saved["topology"]["world_size"] == nproc


def test_conversion_of_a_plain_checkpoint_is_exact_and_cached_for_that_checkpoint_only(tmp_path, tmp_path_factory,
                                                                                      tiny_data):
    from transformers import AutoConfig, AutoModelForCausalLM

    checkpoint = plain_source(tmp_path_factory, tiny_data) / "checkpoints" / step_dir_name(HALF)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(checkpoint / "hf"))
    digest, dest = state_sha256(checkpoint, STATE_FILE), tmp_path / "portable"
    meta = convert(checkpoint, dest, deepspeed_dir=None, param_names=optimizer_param_names(model, False),
                   source_layout=layout(1, None), source_sha256=digest)
    assert set(meta["params"]) == {name for name, _ in model.named_parameters()}
    assert set(meta["step"].values()) == {HALF}
    for name in (PARAM, "model.norm.weight"):  # one of each optimizer group
        saved, converted = saved_plain(checkpoint, name), {k: portable_tensor(dest, k, name) for k in
                                                           ("fp32", "exp_avg", "exp_avg_sq")}
        assert all(torch.equal(converted[k], saved[k]) for k in converted)
    assert cached_portable(dest, digest) and not cached_portable(dest, "0" * 64)  # another checkpoint's cache
    next(dest.glob("exp_avg_sq-*.safetensors")).unlink()
    assert not cached_portable(dest, digest)  # incomplete: converted again


def portable_tensor(folder: Path, key: str, name: str) -> torch.Tensor:
    """One tensor of a state of the topology-free form, found through that state's index."""
    weight_map = json.loads((folder / f"{key}.safetensors.index.json").read_text())["weight_map"]
    return load_file(folder / weight_map[name])[name]


def probe(tmp_path: Path, data: Path, checkpoint: Path, nproc: int, overrides: list[str]) -> dict[str, torch.Tensor]:
    out = tmp_path / "probe.safetensors"
    args = [str(ROOT / "tests" / "integration" / "resume_probe.py"), str(out), PARAM, "recipes/tiny.yaml", f"out_dir={tmp_path / 'run'}",
            f"data.path={data}", *TINY_OVERRIDES, f"train.max_steps={STEPS}", f"checkpoint.resume={checkpoint}", *overrides]
    proc = run_script(args, nproc=nproc)
    assert "on a new layout" in proc.stderr
    return load_file(out)


def saved_zero2(checkpoint: Path, name: str) -> dict[str, torch.Tensor]:
    """A parameter's fp32 weight and moments straight from ZeRO-1/2 shards, by the slice map DeepSpeed records."""
    shards = sorted((checkpoint / DS_TAG).glob("zero_pp_rank_*_mp_rank_00_optim_states.pt"))
    pieces = {"fp32": [], "exp_avg": [], "exp_avg_sq": []}
    shape = None
    for shard in shards:
        osd = torch.load(shard, map_location="cpu", weights_only=False)["optimizer_state_dict"]
        for group, mapping in enumerate(osd["param_slice_mappings"]):
            if name in mapping:
                address = mapping[name]
                flats = {"fp32": osd["single_partition_of_fp32_groups"][group],
                         **{k: osd["base_optimizer_state"]["state"][group][k] for k in ("exp_avg", "exp_avg_sq")}}
                for key, flat in flats.items():
                    pieces[key].append(flat.narrow(0, address.start, address.numel))
    model_states = torch.load(checkpoint / DS_TAG / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
    shape = next(shapes[name] for shapes in model_states["param_shapes"] if name in shapes)
    return {key: torch.cat(parts).view(shape) for key, parts in pieces.items()}


def saved_plain(checkpoint: Path, name: str) -> dict[str, torch.Tensor]:
    """A parameter's weight and moments from model.safetensors and optimizer.bin (numbered in optimizer order)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(checkpoint / "hf"))
    index = [names[0] for names in optimizer_param_names(model, decay_embeddings=False)].index(name)
    optim = torch.load(checkpoint / "optimizer.bin", map_location="cpu", weights_only=True)
    return {"fp32": load_file(checkpoint / "model.safetensors")[name], **{k: optim["state"][index][k] for k in ("exp_avg", "exp_avg_sq")}}


@pytest.mark.slow
@pytest.mark.parametrize("case", ["zero2-to-zero3", "none-1p-to-zero1-2p"])
def test_adamw_moments_after_loading_equal_the_saved_ones(tmp_path, tiny_data, sources, case):
    source_name, nproc, overrides, _ = CASES[case]
    checkpoint = sources[source_name]["checkpoint"]
    loaded = probe(tmp_path, tiny_data, checkpoint, nproc, overrides)
    saved = (saved_zero2 if source_name == "zero2" else saved_plain)(checkpoint, PARAM)
    for key in ("fp32", "exp_avg", "exp_avg_sq"):
        assert loaded[key].shape == saved[key].shape
        assert torch.equal(loaded[key], saved[key].float()), f"{key}: max |difference| {(loaded[key] - saved[key]).abs().max()}"
    assert saved["exp_avg_sq"].abs().sum() > 0  # real moments, not a fresh optimizer's zeros
    assert loaded["steps"].tolist() == [float(HALF)] * len(loaded["steps"])
