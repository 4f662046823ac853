"""Mixture-of-experts models from recipes (docs/moe.md): the recipe keys in the model class's config, total and active
parameters, the optimizer groups DeepSpeed AutoEP needs, ZeRO-3 leaf modules, the DeepSpeed JSON's expert_parallel
section, and the one place that works around transformers 5.23 and DeepSpeed AutoEP disagreeing."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import ROOT, TINY_OVERRIDES

from lmrecipe.config import load_config
from lmrecipe.data.batches import BatchLayout
from lmrecipe.parallel.deepspeed_config import load_deepspeed_config
from lmrecipe.parallel.splits import autoep_registry_compat
from lmrecipe.errors import UserError
from lmrecipe.model.routing import expert_tokens
from lmrecipe.model.build import build_hf_config, build_model, param_counts, set_moe_leaf_modules
from lmrecipe.observe.console import load_balance
from lmrecipe.optim import expert_params, param_groups

TINY = ROOT / "recipes" / "tiny.yaml"
MOE = ["model.arch=qwen3_moe", "model.num_experts=4", "model.experts_per_token=2", "model.hidden_size=32",
       "model.intermediate_size=64", "model.expert_intermediate_size=16"]


def moe_model(arch: str = "qwen3_moe", extra: tuple = ()):
    cfg = load_config(TINY, [*TINY_OVERRIDES, *MOE, f"model.arch={arch}", *extra])
    hf_config = build_hf_config(cfg.model, 384, cfg.data.seq_len)
    return cfg, hf_config, build_model(cfg.model, cfg.train, hf_config)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_the_recipe_keys_shape_the_model_class(arch):
    cfg, hf_config, model = moe_model(arch)
    experts = [p for name, p in model.named_parameters() if ".experts." in name]
    assert hf_config.num_experts_per_tok == 2 and hf_config.output_router_logits
    assert hf_config.router_aux_loss_coef == cfg.model.router_aux_loss_coef == 0.001
    # 2 layers x (gate_up [4, 2 x 16, 32] + down [4, 32, 16]): every expert of width 16
    assert sorted(tuple(p.shape) for p in experts) == [(4, 32, 16)] * 2 + [(4, 32, 32)] * 2
    counts = param_counts(model)
    expert_total = sum(p.numel() for p in experts)
    assert counts["active"] == counts["total"] - expert_total // 2  # 2 of 4 experts per token


def test_a_shared_expert_is_built_where_the_architecture_has_one():
    _, hf_config, model = moe_model("qwen2_moe", ("model.shared_experts=1",))
    assert hf_config.shared_expert_intermediate_size == 16
    shared = [name for name, _ in model.named_parameters() if "shared_expert." in name]
    assert len(shared) == 2 * 3  # gate, up and down projections in each of 2 layers
    assert not any("shared_expert" in name for name in _names(expert_params(model), model))


def test_the_config_and_the_model_know_the_same_moe_architectures():
    from lmrecipe.config.sections import MOE_ARCHS, SHARED_EXPERT_ARCHS
    from lmrecipe.model.build import MOE_ARCHS as MODEL_MOE_ARCHS

    assert set(MOE_ARCHS) == set(MODEL_MOE_ARCHS)
    assert {arch for arch, keys in MODEL_MOE_ARCHS.items() if keys.shared_width} == set(SHARED_EXPERT_ARCHS)
    with pytest.raises(UserError, match="model.arch=qwen2_moe has 1 shared expert.s. per layer. Set model.shared_"):
        load_config(TINY, [*TINY_OVERRIDES, *MOE, "model.arch=qwen2_moe"])


def _names(params, model) -> list[str]:
    ids = {id(p) for p in params}
    return [name for name, p in model.named_parameters() if id(p) in ids]


def test_expert_parameters_get_their_own_groups_marked_for_deepspeed():
    cfg, _, model = moe_model()
    groups = param_groups(model, cfg.optim, expert_group="ep_size_2")
    experts = {id(p) for p in expert_params(model)}
    moe = [g for g in groups if g.get("moe")]
    assert [g["name"] for g in moe] == ["ep_size_2"] and moe[0]["weight_decay"] == cfg.optim.weight_decay
    assert {id(p) for g in moe for p in g["params"]} == experts and len(experts) == 4
    assert not any(id(p) in experts for g in groups if not g.get("moe") for p in g["params"])
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))
    # Without AutoEP: the two groups of a dense model, the experts among the decayed matrices.
    assert [len(g["params"]) for g in param_groups(model, cfg.optim)] == [len(groups[0]["params"]) + 4,
                                                                           len(groups[1]["params"])]


def test_zero3_makes_every_moe_block_a_leaf_module():
    from deepspeed.utils import z3_leaf_module

    _, _, model = moe_model()
    assert set_moe_leaf_modules(model) == ["Qwen3MoeSparseMoeBlock"]
    blocks = [m for m in model.modules() if type(m).__name__ == "Qwen3MoeSparseMoeBlock"]
    assert len(blocks) == 2 and all(z3_leaf_module(m) for m in blocks)


def test_tokens_per_expert_and_the_load_balance():
    chosen = (torch.tensor([[0, 1], [0, 2], [3, 0]]), torch.tensor([[3, 2]] * 3))  # each token's 2 experts
    counts = torch.stack([expert_tokens(layer, 4) for layer in chosen])
    assert counts.tolist() == [[3.0, 1.0, 1.0, 1.0], [0.0, 0.0, 3.0, 3.0]]
    assert load_balance(counts) == {"load_balance/layer0": 2.0, "load_balance/layer1": 2.0}
    # AutoEP's router counts its tokens per expert itself: taken as they are.
    assert expert_tokens(torch.tensor([3, 1, 1, 1], dtype=torch.int32), 4).tolist() == [3.0, 1.0, 1.0, 1.0]


def _ds_config(tmp_path, overrides: list[str], section: dict | None = None) -> dict:
    ds = json.loads((ROOT / "ds_configs" / "zero1.json").read_text())
    if section is not None:
        ds["expert_parallel"] = section
    path = tmp_path / "custom.json"
    path.write_text(json.dumps(ds))
    cfg = load_config(TINY, [*TINY_OVERRIDES, *MOE, f"distributed.deepspeed_config={path}", *overrides])
    return load_deepspeed_config(path, cfg.optim, cfg.distributed, BatchLayout.from_config(cfg.train, 2), "fp32")


def test_the_expert_parallel_section_comes_from_the_recipe(tmp_path):
    ds = _ds_config(tmp_path, ["distributed.expert_parallel_size=2"], {"comm_backend": "comm"})
    assert ds["expert_parallel"] == {"comm_backend": "comm", "enabled": True, "autoep_size": 2}
    assert "expert_parallel" not in _ds_config(tmp_path, [])  # the model class's own block: no AutoEP
    with pytest.raises(UserError, match="sets load_balance_coeff in its 'expert_parallel' section"):
        _ds_config(tmp_path, ["distributed.expert_parallel_size=2"], {"load_balance_coeff": 0.01})
    with pytest.raises(UserError, match=r"set\sdistributed.expert_layer=autoep .or distributed.expert_parallel_size"):
        _ds_config(tmp_path, [], {"comm_backend": "comm"})


def test_the_registry_workaround_is_still_needed_and_only_inside_its_context():
    """Fails once transformers' registry takes a class name and a default again (or DeepSpeed stops passing them):
    then ``distributed.autoep_registry_compat`` and its use in ``train/setup.py`` can go."""
    from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY, _CanRecordRegistry

    original = _CanRecordRegistry.get
    key = "<class 'lmrecipe.TestBlock'>"
    missing = object()
    with pytest.raises(TypeError, match="takes 2 positional arguments"):
        _CAN_RECORD_REGISTRY.get(key, missing)  # what DeepSpeed AutoEP calls while it builds the engine
    with autoep_registry_compat():
        assert _CAN_RECORD_REGISTRY.get(key, missing) is missing
        dict.__setitem__(_CAN_RECORD_REGISTRY, key, {"router_logits": 1})
        try:
            assert _CAN_RECORD_REGISTRY.get(key) == {"router_logits": 1}
        finally:
            dict.pop(_CAN_RECORD_REGISTRY, key)
    assert _CanRecordRegistry.get is original


def test_the_planner_and_the_estimator_count_total_active_and_each_ranks_experts():
    from lmrecipe.parallel.topology import ZeroSetup
    from lmrecipe.planning.memory import estimate_model_states, model_shape
    from lmrecipe.planning.shapes import shape_from_config

    cfg, hf_config, model = moe_model("mixtral")
    counts, shape = param_counts(model), model_shape(hf_config)
    planned = shape_from_config(cfg.model, 384)
    assert (planned.n_params, planned.n_active) == (shape.n_params, shape.active()) == (counts["total"],
                                                                                       counts["active"])
    assert shape.expert_params == sum(p.numel() for p in expert_params(model))
    zero1 = ZeroSetup(stage=1, deepspeed=True)
    whole = estimate_model_states(shape, zero1, 2, 2, "fp32", 1)["model_states"]
    dense, experts = shape.split_experts(2)
    split = sum(estimate_model_states(part, zero1, ranks, 2, "fp32", 1)["model_states"]
                for part, ranks in ((dense, 2), (experts, 1)))
    # fp32 ZeRO-1 on 2 ranks, one micro-step (memory.py's table): 4 + (4 + 12) / 2 bytes a parameter; a rank's half of
    # the experts, in an expert group of 1 rank that partitions nothing: (4 + 4 + 12) / 2 bytes an expert parameter.
    assert whole - split == pytest.approx(shape.expert_params * (12 - 20 / 2))


def test_autoep_resumes_onto_any_expert_parallel_size_but_not_onto_another_moe_layer(tmp_path):
    from lmrecipe.checkpoint.resume import _check_expert_layer

    def config(ep: int, layer: str = "auto") -> dict:
        return {"distributed": {"expert_parallel_size": ep, "expert_layer": layer}}

    for saved, ours in ((config(2), config(1, "autoep")), (config(1, "autoep"), config(4)), (config(1), config(1))):
        _check_expert_layer(tmp_path, saved, ours)
    with pytest.raises(UserError, match=r"saved with DeepSpeed AutoEP's MoE layers .* Resume with "
                                        r"distributed.expert_layer=autoep"):
        _check_expert_layer(tmp_path, config(2), config(1))
    with pytest.raises(UserError, match=r"saved with the model class's own MoE block.* Resume with "
                                        r"distributed.expert_layer=hf"):
        _check_expert_layer(tmp_path, config(1, "hf"), config(2))


def test_a_change_of_autoep_size_is_a_change_of_layout_and_auto_names_the_layer_it_picks():
    from lmrecipe.checkpoint.compat import _resolved
    from lmrecipe.checkpoint.resume import saved_layout
    from lmrecipe.parallel.topology import Topology, ZeroSetup

    zero1 = ZeroSetup(stage=1, deepspeed=True)
    saved, now = Topology(2, zero1, expert_parallel_size=2, autoep=True), Topology(2, zero1)
    assert now.changes_from(saved) == ["expert parallel 2 -> 1"] and now.needs_conversion_from(saved)
    assert Topology.from_record(saved.record()) == saved
    record = {"topology": {"world_size": 2, "deepspeed": True, "zero_stage": 1},  # from before the size was recorded
              "config": {"distributed": {"expert_parallel_size": 2, "expert_layer": "auto"}}}
    assert saved_layout(record) == saved
    # auto at size 2 is AutoEP's layer: resuming it at size 1 with expert_layer=autoep changes no fixed key.
    picked = [_resolved({"distributed.expert_parallel_size": ep, "distributed.expert_layer": layer}, {})
              ["distributed.expert_layer"] for ep, layer in ((2, "auto"), (1, "autoep"), (1, "auto"), (1, "hf"))]
    assert picked == ["autoep", "autoep", "hf", "hf"]


def test_a_rank_takes_its_own_experts_of_the_whole_tensor():
    from lmrecipe.checkpoint.ep_split import expert_splits, experts_of, place
    from lmrecipe.checkpoint.portable import _LocalExperts

    layer = {"num_experts": 4, "ep_size": 2, "expert_key_prefix": "model.layers.0.mlp.experts"}
    splits = expert_splits([layer, {**layer, "expert_key_prefix": "model.layers.1.mlp.experts",
                                    "expert_placement": {"ranks": [{"rank": 1, "experts": [1, 3]},
                                                                   {"rank": 0, "experts": [0, 2]}]}}])
    assert len(splits) == 6 and splits["model.layers.0.mlp.experts.w3"].by_rank == ((0, 1), (2, 3))
    interleaved = splits["model.layers.1.mlp.experts.w1"]
    assert interleaved.by_rank == ((0, 2), (1, 3)) and interleaved.ranks_of(1, 6) == [1, 3, 5]
    whole = torch.arange(4 * 3 * 2, dtype=torch.float32).view(4, 3, 2)
    rebuilt = torch.empty_like(whole)
    for experts in interleaved.by_rank:
        place(rebuilt, experts_of(whole, experts), experts)
    assert torch.equal(rebuilt, whole) and torch.equal(experts_of(whole, (1, 3)), whole[[1, 3]])
    with pytest.raises(UserError, match="does not hold each of its 4 experts once"):
        expert_splits([{**layer, "expert_placement": {"ranks": [{"rank": 0, "experts": [0, 1]},
                                                                {"rank": 1, "experts": [1, 2]}]}}])

    class Whole:  # the topology-free form's reads, in memory
        meta = {"params": {"e": [4, 3, 2]}}

        def get(self, key, name):
            return whole

        def get_flat(self, key, name, start, numel):
            return whole.reshape(-1)[start:start + numel]

    for experts in ((2, 3), (1, 3)):  # contiguous rows are read as one range; others gathered
        local = _LocalExperts(Whole(), {"e": experts})
        assert torch.equal(local.get("fp32", "e"), whole[list(experts)])
        assert torch.equal(local.get_flat("fp32", "e", 4, 5), whole[list(experts)].reshape(-1)[4:9])


def test_init_from_refuses_expert_keys_that_contradict_the_model_and_returns_its_router_logits(tmp_path):
    cfg, hf_config, model = moe_model()
    model.config.output_router_logits = False  # as a model from elsewhere may be saved
    model.save_pretrained(tmp_path / "moe")
    dense = load_config(TINY, TINY_OVERRIDES)
    build_hf_config(dense.model, 384, dense.data.seq_len).save_pretrained(tmp_path / "dense")

    def refusal(folder: str, *keys: str) -> str:
        run = load_config(TINY, [*TINY_OVERRIDES, *MOE, f"model.init_from={tmp_path / folder}", *keys])
        with pytest.raises(UserError) as err:
            build_hf_config(run.model, 384, run.data.seq_len)
        return str(err.value)

    top1 = refusal("moe", "model.experts_per_token=1")
    assert f"model.init_from={tmp_path / 'moe'} is an MoE model of 4 routed experts per layer, 2 per token " \
           "(num_experts=4, num_experts_per_tok=2 in its config.json), and this run says model.experts_per_token=1 " \
           "(the model's: 2)" in top1
    assert "Set model.experts_per_token=2 (to route each token to another number of experts, edit " \
           f"num_experts_per_tok in {tmp_path / 'moe'}/config.json" in top1
    assert "model.num_experts=8 (the model's: 4)" in refusal("moe", "model.num_experts=8")
    # A dense recipe would train it without its router loss.
    assert "this run says model.num_experts=0 (the model's: 4). " in refusal("moe", "model.num_experts=0")
    assert "is a dense model (no experts in its config.json), and this run says model.num_experts=4 (the model's: 0)" \
        in refusal("dense") and "Set model.num_experts=0," in refusal("dense")

    same = load_config(TINY, [*TINY_OVERRIDES, *MOE, f"model.init_from={tmp_path / 'moe'}"])
    continued = build_model(same.model, same.train, build_hf_config(same.model, 384, same.data.seq_len))
    assert continued.config.num_experts_per_tok == 2 and continued.config.output_router_logits


@pytest.mark.parametrize("arch, extra, mlp", [
    ("qwen3_moe", (), "MoE MLP: 4 experts of width 16, each token routed to the top 2, vocabulary"),
    ("mixtral", (), "MoE MLP: 4 experts of width 16, each token routed to the top 2, vocabulary"),
    ("qwen2_moe", ("model.shared_experts=1",),
     "MoE MLP: 4 experts of width 16, each token routed to the top 2, and a shared expert of width 16, vocabulary"),
])
def test_the_model_card_of_an_moe_export_names_its_experts_and_active_parameters(tmp_path, tiny_data, arch, extra,
                                                                                   mlp):
    import shutil

    from lmrecipe.export import model_card, write_export

    cfg, hf_config, model = moe_model(arch, extra)
    ckpt = tmp_path / "checkpoints" / "step_00000003"
    hf_config.save_pretrained(ckpt / "hf")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_data / name, ckpt / "hf" / name)
    saved = {"config": cfg.to_dict(), "hf_config": hf_config.to_dict(), "state": {"step": 3, "tokens_seen": 768}}
    out = write_export(tmp_path / "export", model.state_dict(), ckpt, dtype="fp32", max_shard_size=10**9,
                       card=lambda n, active: model_card(ckpt, saved, n, "fp32", "raw", n_active=active),
                       what="exporting", retry="")
    card = (out / "README.md").read_text()
    counts = param_counts(model)
    assert f"with {counts['total']:,} parameters ({counts['total'] / 1e6:.2f}M; {counts['active']:,} active per " \
           "token)" in card
    assert mlp in card and "MLP 64" not in card
