"""The expert load counted from the experts the routers really chose (lmrecipe/model/routing.py), and DeepSeek-V3's
auxiliary-loss-free balancing (model.router_bias_update_rate): its rule, its refusals, and a run whose bias moves,
stays fp32, survives a resume exactly and is exported."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import LOSS_TOL, ROOT, TINY_OVERRIDES

from lmrecipe.checkpoint.storage import step_dir_name
from lmrecipe.config import load_config
from lmrecipe.errors import UserError
from lmrecipe.model.build import build_hf_config, build_model
from lmrecipe.model.loss import training_loss
from lmrecipe.model.routing import (RouterLoads, expert_tokens, keep_biases_fp32, routers, routing_biases,
                                    update_routing_biases_)

TINY = ROOT / "recipes" / "tiny.yaml"
EXPERTS, TOP_K = 8, 2
# Latent attention, one shared expert, 8 routed experts in 4 groups of which each token may use 2 (DeepSeek-V3's
# shape, shrunk), every layer an MoE layer.
DEEPSEEK = ["model.arch=deepseek_v3", "model.hidden_size=32", "model.num_heads=4", "model.intermediate_size=64",
            "model.router_aux_loss_coef=0", f"model.num_experts={EXPERTS}", f"model.experts_per_token={TOP_K}",
            "model.expert_intermediate_size=16", "model.shared_experts=1", "model.expert_groups=4",
            "model.expert_groups_per_token=2", "model.dense_layers=0", "model.q_lora_rank=0", "model.kv_lora_rank=16",
            "model.qk_nope_head_dim=8", "model.qk_rope_head_dim=8", "model.v_head_dim=16",
            "model.routed_scaling_factor=1.0"]


def deepseek_overrides() -> list[str]:
    return list(DEEPSEEK)


def tiny_deepseek(extra: tuple = ()):
    cfg = load_config(TINY, [*TINY_OVERRIDES, *deepseek_overrides(), *extra])
    return build_model(cfg.model, cfg.train, build_hf_config(cfg.model, 384, cfg.data.seq_len))


def experts_run(model) -> tuple[list[torch.Tensor], list]:
    """Tokens each layer's experts module really received (its ``top_k_index`` argument), and the hooks' handles."""
    received, handles = [], []
    for router in routers(model):
        block = next(m for m in model.modules() if getattr(m, "gate", None) is router)
        handles.append(block.experts.register_forward_pre_hook(
            lambda module, args: received.append(torch.bincount(args[1].flatten(), minlength=EXPERTS).float())))
    return received, handles


def test_the_load_is_the_experts_deepseek_v3_really_chose_not_a_top_k_of_its_logits():
    model = tiny_deepseek()
    biases = routing_biases(model)
    assert len(biases) == 2 and all(b.dtype == torch.float32 for b in biases)
    with torch.no_grad():  # a bias that moves the choice: experts 0 and 1 favoured, 6 and 7 shunned
        for bias in biases:
            bias.copy_(torch.tensor([0.5, 0.3, 0.0, 0.0, 0.0, 0.0, -0.5, -0.5]))
    loads = RouterLoads(model)
    received, handles = experts_run(model)
    inputs = torch.randint(0, 384, (4, 32), generator=torch.Generator().manual_seed(0))
    terms = training_loss(model, inputs, inputs, router_loads=loads)
    for handle in handles:
        handle.remove()
    counted = terms.expert_tokens
    assert counted.shape == (2, EXPERTS) and torch.equal(counted, torch.stack(received))
    assert counted.sum(dim=1).tolist() == [4 * 32 * TOP_K] * 2
    # What the old count took: the top-k of the logits, blind to the bias and the group limit.
    logits = model(input_ids=inputs, output_router_logits=True).router_logits
    top_k = torch.stack([expert_tokens(layer.topk(TOP_K, dim=-1).indices, EXPERTS) for layer in logits])
    assert not torch.equal(top_k, counted)
    assert counted[:, 6:].sum() == 0 < top_k[:, 6:].sum()


def test_a_qwen3_moe_load_is_counted_from_its_chosen_experts_and_nothing_outside_the_training_forward():
    cfg = load_config(TINY, [*TINY_OVERRIDES, "model.arch=qwen3_moe", "model.num_experts=4",
                             "model.experts_per_token=2", "model.hidden_size=32", "model.intermediate_size=64",
                             "model.expert_intermediate_size=16",
                             "train.gradient_checkpointing=true"])
    model = build_model(cfg.model, cfg.train, build_hf_config(cfg.model, 384, cfg.data.seq_len))
    loads = RouterLoads(model)
    inputs = torch.randint(0, 384, (2, 16), generator=torch.Generator().manual_seed(1))
    with loads.recording() as chosen:
        outputs = model(input_ids=inputs, output_router_logits=True)
    counted = RouterLoads.stacked(chosen)
    # Softmax top-k: here the logits' top-k is the router's choice.
    top_k = [expert_tokens(layer.topk(2, dim=-1).indices, 4) for layer in outputs.router_logits]
    assert torch.equal(counted, torch.stack(top_k))
    calls = []
    handles = [router.register_forward_hook(lambda *args: calls.append(1)) for router in loads.routers]
    outputs.logits.sum().backward()  # the activation checkpoints' recompute runs the routers again: not counted
    assert len(calls) == 2 and torch.equal(RouterLoads.stacked(chosen), counted)
    for handle in handles:
        handle.remove()
    with torch.no_grad():
        model(input_ids=inputs)  # a validation forward: not counted either
    assert torch.equal(RouterLoads.stacked(chosen), counted)


def test_the_bias_moves_by_the_rate_toward_balance_and_not_on_a_skipped_step():
    biases = [torch.zeros(4), torch.full((4,), 0.25)]
    tokens = torch.tensor([[10.0, 2.0, 4.0, 0.0], [4.0, 4.0, 4.0, 4.0]])  # layer 0: mean 4
    update_routing_biases_(biases, tokens, 0.01, torch.tensor(False))
    assert biases[0].tolist() == pytest.approx([-0.01, 0.01, 0.0, 0.01]) and biases[1].tolist() == [0.25] * 4
    update_routing_biases_(biases, tokens, 0.01, torch.tensor(True))  # a skipped update leaves the bias too
    update_routing_biases_(biases, tokens, 0.01, True)
    assert biases[0].tolist() == pytest.approx([-0.01, 0.01, 0.0, 0.01])


def test_a_bf16_bias_is_made_fp32_again():
    model = tiny_deepseek().to(torch.bfloat16)
    assert {b.dtype for b in routing_biases(model)} == {torch.bfloat16}
    keep_biases_fp32(model)
    assert {b.dtype for b in routing_biases(model)} == {torch.float32}
    assert all(name in dict(model.named_buffers()) for name in ("model.layers.0.mlp.gate.e_score_correction_bias",))


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_an_architecture_without_a_routing_bias_is_refused(arch):
    moe = ["model.num_experts=4"] if arch != "llama" else []
    with pytest.raises(UserError, match=rf"model.arch={arch}'s router has none: only deepseek_v3 routes with one. "
                                        r"Set model.router_bias_update_rate=0"):
        load_config(TINY, [*TINY_OVERRIDES, f"model.arch={arch}", *moe, "model.router_bias_update_rate=0.001"])
    with pytest.raises(UserError, match=r"must be a finite number >= 0"):
        load_config(TINY, [*TINY_OVERRIDES, "model.router_bias_update_rate=-1"])


# ---- a run: in process, one rank, the bias updated every step

RUN = ["train.precision=fp32", "schedule.decay=constant", "model.router_bias_update_rate=0.01",
       "data.document_masking=false",
       "train.eval_every_steps=4", "checkpoint.every_steps=4", "checkpoint.keep_last=3"]


def _train(out, tiny_data, overrides):
    from lmrecipe.train.trainer import train

    cfg = load_config(TINY, [f"out_dir={out}", f"data.path={tiny_data}", *TINY_OVERRIDES, *deepseek_overrides(), *RUN,
                             *overrides])
    train(cfg)


def _bias(folder) -> dict[str, torch.Tensor]:
    """The routing biases of a checkpoint (its weights as the export takes them) or of an export folder."""
    from safetensors.torch import load_file

    from lmrecipe.export import checkpoint_state_dict

    if (folder / "train_state.json").is_file():
        weights = checkpoint_state_dict(folder, torch.float32)
    else:
        weights = {}
        for file in sorted(folder.glob("*.safetensors")):
            weights.update(load_file(file))
    return {name: t for name, t in weights.items() if name.endswith("e_score_correction_bias")}


def _losses(out) -> dict[int, float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def test_the_bias_moves_each_step_is_resumed_exactly_onto_another_layout_and_exported(tmp_path, tiny_data,
                                                                                      deepspeed_in_process):
    """An uninterrupted run of 8 steps against one stopped at step 4 and resumed under DeepSpeed ZeRO-1: a new layout,
    whose weights come from the topology-free form (parameters only), and the bias from the callback's state."""
    from transformers import AutoModelForCausalLM

    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    _train(whole, tiny_data, ["train.max_steps=8", "checkpoint.export_at_end=true", "checkpoint.export_dtype=fp32"])
    _train(resumed, tiny_data, ["train.max_steps=4"])
    _train(resumed, tiny_data, ["train.max_steps=8", "checkpoint.resume=auto", "distributed.deepspeed_config=zero1"])
    step4, step8 = (_bias(whole / "checkpoints" / step_dir_name(s)) for s in (4, 8))
    assert len(step8) == 2 and all(b.dtype == torch.float32 for b in step8.values())
    for name, bias in step4.items():
        # Every step moves each expert by 0 or +-0.01 (an even split does not move it): 4 steps, at most 0.04.
        assert 0 < bias.abs().max() <= 0.04 + 1e-7 and not torch.equal(bias, step8[name])
    saved = json.loads((whole / "checkpoints" / step_dir_name(8) / "train_state.json").read_text())
    assert torch.equal(torch.tensor(saved["extras"]["routing_bias"]["biases"]), torch.stack(list(step8.values())))
    after = _bias(resumed / "checkpoints" / step_dir_name(8))  # consolidated from the ZeRO-1 shards' module states
    assert after.keys() == step8.keys() and all(torch.equal(after[n], step8[n]) for n in step8), (after, step8)
    got, want = _losses(resumed), _losses(whole)
    assert sorted(got) == list(range(1, 9)) and max(abs(got[s] - want[s]) for s in range(5, 9)) <= LOSS_TOL
    exported = _bias(whole / "export")
    assert exported.keys() == step8.keys() and all(torch.equal(exported[n], step8[n]) for n in step8)
    model = AutoModelForCausalLM.from_pretrained(whole / "export")
    for name, bias in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            assert bias.dtype == torch.float32 and torch.equal(bias, step8[name])


def test_the_bias_update_adds_no_host_sync(tmp_path, tiny_data):
    """Two runs with the same sync points (step 1, the last) differ only by 4 unlogged steps: same host reads."""
    from lmrecipe.observe.host_syncs import HostSyncCounter
    from lmrecipe.train.trainer import train

    def syncs(name: str, steps: int) -> HostSyncCounter:
        cfg = load_config(TINY, [f"out_dir={tmp_path / name}", f"data.path={tiny_data}", *TINY_OVERRIDES,
                                 *deepseek_overrides(), "model.router_bias_update_rate=0.01",
                                 f"train.max_steps={steps}",
                                 "logging.log_every_steps=1000", "train.eval_every_steps=0", "checkpoint.every_steps=0",
                                 "checkpoint.resume=none"])
        with HostSyncCounter() as counter:
            train(cfg)
        return counter

    short, long = syncs("short", 2), syncs("long", 6)
    assert short.total > 0 and long.total == short.total, f"short {short.calls}, long {long.calls}"
