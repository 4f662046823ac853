"""Config schema: every recipe loads, precedence, strictness, and errors without tracebacks."""

from __future__ import annotations

import ast
import dataclasses
import typing
from pathlib import Path

import pytest
import yaml
from helpers import ROOT, TINY_OVERRIDES

from lmrecipe.config import RULES, Config, check_rules, config_from_dict, load_config, save_config
from lmrecipe.config import loader as config_loader
from lmrecipe.data.batches import BatchLayout
from lmrecipe.errors import UserError

RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))
TINY = ROOT / "recipes" / "tiny.yaml"


def test_recipes_exist():
    names = {p.stem for p in RECIPES}
    assert {"tiny", "llama_125m", "llama_1b", "llama3_8b_continued"} <= names


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_every_recipe_loads_and_round_trips(recipe, tmp_path):
    cfg = load_config(recipe)
    raw = yaml.safe_load(recipe.read_text())
    # Every value the recipe sets is what the config holds.
    for section, values in raw.items():
        if section == "base":  # the recipe it starts from, merged beneath it (loader.py)
            continue
        if isinstance(values, dict):
            for key, value in values.items():
                got = getattr(getattr(cfg, section), key)
                assert got == value or (isinstance(value, (int, float)) and float(got) == float(value)), (section, key)
        else:
            assert getattr(cfg, section) == values
    save_config(cfg, tmp_path / "config.yaml")
    assert config_from_dict(yaml.safe_load((tmp_path / "config.yaml").read_text())) == cfg


def test_precedence_defaults_recipe_cli(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("optim:\n  lr: 1.0e-3\n  min_lr: 1.0e-5\ntrain:\n  max_steps: 50\n")
    assert load_config(None).optim.lr == Config().optim.lr  # defaults
    cfg = load_config(recipe)
    assert (cfg.optim.lr, cfg.train.max_steps, cfg.optim.weight_decay) == (1e-3, 50, Config().optim.weight_decay)
    cfg = load_config(recipe, ["optim.lr=3e-4", "train.max_steps=7", "distributed.deepspeed_config=null"])
    assert (cfg.optim.lr, cfg.train.max_steps, cfg.distributed.deepspeed_config) == (3e-4, 7, None)
    cfg = load_config(recipe, ["train.gradient_checkpointing=true", "model.extra={rms_norm_eps: 0.001}"])
    assert cfg.train.gradient_checkpointing is True and cfg.model.extra == {"rms_norm_eps": 0.001}


@pytest.mark.parametrize(
    "override, expected",
    [
        ("optim.lrr=1", "Did you mean optim.lr?"),
        ("optimm.lr=1", "Did you mean optim?"),
        ("optim.lr=fast", "optim.lr='fast' must be a number"),
        ("train.max_steps=1.5", "train.max_steps='1.5' must be an integer"),
        ("train.precision=bf32", "Choose one of: auto, bf16, fp16, fp32"),
        ("train.gradient_checkpointing=maybe", "must be a boolean"),
        ("train.max_steps=0", "train.max_steps=0 must be positive"),
        ("optim.beta2=1.5", "optim.beta2=1.5 must be in [0, 1)"),
        ("train.micro_batch_size=5", "must be a multiple of train.micro_batch_size=5"),
        ("model.num_heads=3", "must be divisible by model.num_heads=3"),
        ("distributed.deepspeed_config=ds_configs/zero9.json", "ds_configs/zero3.json"),
        ("optim.lr", "must look like key=value"),
        ("model=3", "model is a section"),
    ],
)
def test_bad_overrides_name_the_key(override, expected):
    with pytest.raises(UserError) as err:
        load_config(ROOT / "recipes" / "tiny.yaml", [override])
    assert expected in str(err.value)


@pytest.mark.parametrize("override", ["train.z_loss=nan", "train.z_loss=inf", "checkpoint.remote_wait_s=nan",
                                      "train.early_stopping_min_delta=inf"])
def test_a_non_finite_value_of_a_non_negative_key_is_refused_naming_it(override):
    with pytest.raises(UserError, match=f"{override.replace('.', '[.]')} must be a finite number, zero or positive"):
        load_config(ROOT / "recipes" / "tiny.yaml", [override])


def test_updates_that_stop_being_finite_name_a_large_z_loss_first():
    from types import SimpleNamespace

    from lmrecipe.config import TrainConfig
    from lmrecipe.train.callbacks.stopping import NonFiniteStop

    stops = []
    trainer = SimpleNamespace(state=SimpleNamespace(step=5), request_stop=stops.append)
    for z_loss in (1e30, 1e-4, 0.0):
        NonFiniteStop(TrainConfig(z_loss=z_loss)).at_sync(trainer, longest_skip_run=5)
    large, small, off = (stop.message for stop in stops)
    assert "train.z_loss=1e+30 is large" in large and large.index("z_loss") < large.index("optim.lr")
    assert "set train.z_loss=1e-4 (PaLM's) or 0" in large
    assert "or a lower train.z_loss (now 0.0001)" in small and "z_loss" not in off
    assert all("checkpoint.resume=auto" in m for m in (large, small, off))


def test_bad_recipe_types(tmp_path):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("train:\n  max_steps: many\n")
    with pytest.raises(UserError, match="train.max_steps='many' must be an integer"):
        load_config(recipe)
    recipe.write_text("trian:\n  max_steps: 3\n")
    with pytest.raises(UserError, match="Did you mean train"):
        load_config(recipe)
    with pytest.raises(UserError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")


def test_accumulation_is_derived():
    cfg = load_config(None, ["train.global_batch_size=32", "train.micro_batch_size=4"])
    assert BatchLayout.from_config(cfg.train, 1).accum_steps == 8
    assert BatchLayout.from_config(cfg.train, 4, rank=3).accum_steps == 2
    with pytest.raises(UserError, match="not a multiple of train.micro_batch_size=4 x 3 processes"):
        BatchLayout.from_config(cfg.train, 3)


def test_trackers_are_a_list_of_known_names_and_the_old_key_says_what_replaced_it():
    assert load_config(ROOT / "recipes" / "tiny.yaml", ["logging.trackers=[wandb,mlflow]"]).logging.trackers == [
        "wandb", "mlflow"]
    assert load_config(ROOT / "recipes" / "tiny.yaml", ["logging.trackers=tensorboard"]).logging.trackers == [
        "tensorboard"]
    with pytest.raises(UserError, match="Choose one of: wandb, tensorboard, mlflow"):
        load_config(ROOT / "recipes" / "tiny.yaml", ["logging.trackers=[weights_and_biases]"])
    with pytest.raises(UserError, match=r"replaced by logging.trackers, a list: logging.trackers=\[wandb\]"):
        load_config(ROOT / "recipes" / "tiny.yaml", ["logging.tracker=wandb"])


# --- Recipe inheritance (base:)


def _write(path, text: str):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_a_recipe_overrides_its_base_key_by_key_and_replaces_lists(tmp_path):
    _write(tmp_path / "base.yaml", "model:\n  hidden_size: 128\n  num_layers: 4\noptim:\n  lr: 1.0e-3\n  min_lr: 1.0e-4\n"
                                   "train:\n  max_steps: 50\nlogging:\n  trackers: [wandb, tensorboard]\n")
    child = _write(tmp_path / "child.yaml", "base: base.yaml\nmodel:\n  num_layers: 2\noptim:\n  lr: 2.0e-3\n"
                                           "logging:\n  trackers: [mlflow]\n")
    cfg = load_config(child)
    assert (cfg.model.hidden_size, cfg.model.num_layers) == (128, 2)  # one key of the section from each
    assert (cfg.optim.lr, cfg.optim.min_lr, cfg.train.max_steps) == (2e-3, 1e-4, 50)
    assert cfg.logging.trackers == ["mlflow"]  # a list is a value: replaced, not appended to
    assert cfg.model.intermediate_size == Config().model.intermediate_size  # neither sets it: the default
    assert load_config(child, ["model.num_layers=3"]).model.num_layers == 3  # the command line over both
    save_config(cfg, tmp_path / "resolved.yaml")
    resolved = yaml.safe_load((tmp_path / "resolved.yaml").read_text())
    assert "base" not in resolved and load_config(tmp_path / "resolved.yaml") == cfg  # the resolved file stands alone


def test_bases_chain_each_relative_to_its_own_folder(tmp_path):
    _write(tmp_path / "bases" / "root.yaml", "train:\n  max_steps: 10\n  seed: 7\nout_dir: runs/root\n")
    _write(tmp_path / "bases" / "mid.yaml", "base: root.yaml\ntrain:\n  max_steps: 20\n")
    child = _write(tmp_path / "recipes" / "child.yaml", "base: ../bases/mid.yaml\nout_dir: runs/child\n")
    cfg = load_config(child)
    assert (cfg.train.seed, cfg.train.max_steps, cfg.out_dir) == (7, 20, "runs/child")


def test_a_base_is_a_layer_for_the_choice_of_data(tmp_path):
    _write(tmp_path / "base.yaml", "data:\n  path: data/one\n")
    child = _write(tmp_path / "child.yaml", "base: base.yaml\ndata:\n  sources: [{path: data/a}, {path: data/b}]\n")
    cfg = load_config(child)
    assert cfg.data.path is None and [s.path for s in cfg.data.sources] == ["data/a", "data/b"]


def test_a_cycle_of_bases_is_refused(tmp_path):
    a = _write(tmp_path / "a.yaml", "base: b.yaml\n")
    _write(tmp_path / "b.yaml", "base: a.yaml\ntrain:\n  max_steps: 3\n")
    with pytest.raises(UserError, match="form a cycle") as err:
        load_config(a)
    assert f"{a} -> {tmp_path / 'b.yaml'} -> {tmp_path / 'a.yaml'}" in str(err.value) and err.value.exit_code == 2
    itself = _write(tmp_path / "self.yaml", "base: self.yaml\n")
    with pytest.raises(UserError, match="form a cycle"):
        load_config(itself)


def test_a_missing_base_names_the_recipe_and_where_it_looked(tmp_path):
    child = _write(tmp_path / "child.yaml", "base: llama_2b.yaml\n")
    with pytest.raises(UserError) as err:
        load_config(child)
    message = str(err.value)
    assert f"names base '{tmp_path / 'llama_2b.yaml'}', which does not exist" in message
    assert f"relative to the recipe's folder ({tmp_path}/)" in message
    _write(child, "base: [a.yaml]\n")
    with pytest.raises(UserError, match="name another recipe YAML"):
        load_config(child)


def test_a_problem_in_a_base_names_that_file(tmp_path):
    _write(tmp_path / "base.yaml", "optim:\n  lrr: 1.0\n")
    child = _write(tmp_path / "child.yaml", "base: base.yaml\nbsae: x\n")
    with pytest.raises(UserError) as err:
        load_config(child)
    assert f"In {tmp_path / 'base.yaml'} (a base of {child}): Unknown config key optim.lrr. Did you mean optim.lr?" in (
        str(err.value))
    assert "Unknown config key bsae. Did you mean base?" in str(err.value)


# --- Every problem at once


def test_every_unknown_key_and_wrong_type_is_reported_in_one_message(tmp_path):
    recipe = _write(tmp_path / "r.yaml", "optim:\n  lrr: 1\ntrian:\n  max_steps: 3\ntrain:\n  max_steps: many\n"
                                         "data:\n  path: null\n  sources: [{pth: data/a}, {path: data/b, wieght: 2}]\n")
    with pytest.raises(UserError) as err:
        load_config(recipe, ["model.hiden_size=64", "optim.lr=fast", "train.seed=1"])
    message = str(err.value)
    assert err.value.exit_code == 2 and message.startswith("7 problems in the configuration:")
    for expected in ("Unknown config key optim.lrr. Did you mean optim.lr?", "Unknown config key trian. Did you mean train?",
                     "train.max_steps='many' must be an integer",
                     "Unknown config key data.sources[0].pth. Did you mean data.sources[0].path?",
                     "Unknown config key data.sources[1].wieght. Did you mean data.sources[1].weight?",
                     "Unknown config key model.hiden_size. Did you mean model.hidden_size?",
                     "optim.lr='fast' must be a number"):
        assert f"\n- {expected}" in message, expected


def test_one_problem_reads_as_before():
    with pytest.raises(UserError) as err:
        load_config(TINY, ["optim.lrr=1"])
    assert str(err.value).startswith("Unknown config key optim.lrr. Did you mean optim.lr? Valid keys here: optim.name")


def test_every_out_of_range_value_is_reported_in_one_message():
    with pytest.raises(UserError) as err:
        load_config(TINY, ["train.max_steps=0", "optim.beta2=1.5", "spike.min_history=1"])
    message = str(err.value)
    assert message.startswith("3 problems in the configuration:")
    assert all(part in message for part in ("train.max_steps=0 must be positive", "optim.beta2=1.5 must be in [0, 1)",
                                            "spike.min_history=1 must be at least 2"))


def test_a_range_check_names_each_section_by_its_key_in_the_config():
    from lmrecipe.config.sections.common import section_name

    sections = [f for f in dataclasses.fields(Config) if f.name != "out_dir"]
    assert [section_name(f.default_factory()) for f in sections] == [f.name for f in sections]


def test_bad_yaml_names_the_file_line_and_column(tmp_path):
    recipe = _write(tmp_path / "bad.yaml", "optim:\n  lr: [1,\n  min_lr: 2\n")
    with pytest.raises(UserError, match="is not valid YAML") as err:
        load_config(recipe)
    assert f'in "{recipe}", line 2, column 7' in str(err.value) and err.value.exit_code == 2


# --- The rules table: each row fires, with its message

ZERO1 = "distributed.deepspeed_config=zero1"
SP2, TP2 = "distributed.sequence_parallel_size=2", "distributed.tensor_parallel_size=2"
MOE = ["model.arch=qwen3_moe", "model.num_experts=4"]
AUTOEP = [*MOE, "distributed.deepspeed_config=zero1", "distributed.expert_layer=autoep"]
DEEPSEEK = ["model.arch=deepseek_v3", "model.num_experts=4", "model.shared_experts=1", "model.expert_groups=2",
            "model.expert_groups_per_token=1", "model.dense_layers=1", "model.router_aux_loss_coef=0"]
TRIGGERS = {
    # rule name: (overrides on the tiny recipe, a fragment of the message)
    "qwen3_5_moe_is_multimodal": (["model.arch=qwen3_5_moe"], "Set model.arch=qwen3_5_moe_text"),
    "architecture_keys_of_another_architecture": (["model.kv_lora_rank=16"],
                                                  "model.kv_lora_rank=16 (deepseek_v3): these keys build only"),
    "deepseek_v3_has_no_auxiliary_loss": ([*DEEPSEEK, "model.router_aux_loss_coef=0.001"],
                                          "Set model.router_aux_loss_coef=0."),
    "deepseek_v3_has_no_grouped_query_attention": ([*DEEPSEEK, "model.num_kv_heads=2"], "Set model.num_kv_heads=null."),
    "deepseek_v3_expert_groups": ([*DEEPSEEK, "model.expert_groups=4"],
                                  "model.expert_groups=4 must divide model.num_experts=4 into groups of at least 2"),
    "deepseek_v3_dense_layers_within_layers": ([*DEEPSEEK, "model.dense_layers=2"],
                                               "leaves none of the model.num_layers=2 layers with experts"),
    "qwen3_5_moe_linear_heads": (["model.arch=qwen3_5_moe_text", "model.num_experts=4", "model.shared_experts=1",
                                  "model.linear_value_heads=3"],
                                 "model.linear_value_heads=3 must be a multiple of model.linear_key_heads=16"),
    "moe_architecture": (["model.num_experts=4"],
                         "model.num_experts=4 needs a mixture-of-experts architecture, not model.arch=llama. Choose"),
    "moe_architecture_needs_experts": (["model.arch=mixtral"], "Set model.num_experts (e.g. 8)"),
    "moe_shared_experts": ([*MOE, "model.shared_experts=1"],
                           "model.arch=qwen3_moe has no shared expert(s) per layer. Set model.shared_experts=0, "
                           "or model.arch=qwen2_moe"),
    "experts_need_a_moe_model": (["distributed.expert_layer=hf"], "this model has none (model.num_experts=0)"),
    "expert_parallel_needs_autoep": ([*MOE, "distributed.deepspeed_config=zero1", "distributed.expert_parallel_size=2",
                                      "distributed.expert_layer=hf"], "Set distributed.expert_layer=auto (or autoep)"),
    "autoep_needs_deepspeed": ([*MOE, "distributed.expert_parallel_size=2"],
                               "choose a DeepSpeed config, e.g. distributed.deepspeed_config=zero1"),
    "expert_parallel_divides_experts": ([*MOE, "distributed.deepspeed_config=zero1",
                                         "distributed.expert_parallel_size=3"],
                                        "distributed.expert_parallel_size=3 must divide model.num_experts=4"),
    "autoep_from_init": ([*AUTOEP, "model.init_from=/nowhere"], "model.init_from=/nowhere with DeepSpeed AutoEP"),
    "moe_without_tensor_parallel": ([*MOE, "distributed.deepspeed_config=zero1", TP2],
                                    "cannot be combined with distributed.tensor_parallel_size=2 in this recipe. Choose "
                                    "distributed.tensor_parallel_size=1 (split the experts"),
    "moe_without_sequence_parallel": ([*MOE, "distributed.deepspeed_config=zero1", SP2],
                                      "cannot be combined with distributed.sequence_parallel_size=2"),
    "moe_without_fp8": ([*MOE, "train.precision=fp8"], "cannot be combined with train.precision=fp8"),
    "moe_without_muon": ([*MOE, "optim.name=muon"], "(a mixture-of-experts model) cannot be combined with optim.name=muon"),
    "moe_without_compile": ([*MOE, "train.compile=true"], "cannot be combined with train.compile=model"),
    "moe_without_layer_stats": ([*MOE, "logging.layer_stats=true"], "cannot be combined with logging.layer_stats=true"),
    "autoep_without_ema": ([*AUTOEP, "train.ema_decay=0.9"], "AutoEP's MoE layers (distributed.expert_parallel_size=1, "
                                                             "distributed.expert_layer=autoep) cannot be combined with "
                                                             "train.ema_decay=0.9"),
    "autoep_without_tasks": ([*AUTOEP, "eval.tasks=[next_line]"], "cannot be combined with eval.tasks=['next_line']"),
    "autoep_without_samples": ([*AUTOEP, "eval.samples=[def]"], "cannot be combined with eval.samples=['def']"),
    "autoep_without_gradient_checkpointing": ([*AUTOEP, "train.gradient_checkpointing=true"],
                                              "cannot be combined with train.gradient_checkpointing=true"),
    "heads_divide_hidden_size": (["model.num_heads=3"], "model.hidden_size=64 must be divisible by model.num_heads=3."),
    "kv_heads_divide_heads": (["model.num_kv_heads=3"], "model.num_kv_heads=3 must be a positive divisor of model.num_heads=4"),
    "window_within_positions": (["model.max_position_embeddings=16"],
                                "data.seq_len=32 exceeds the model's max_position_embeddings=16. Lower data.seq_len"),
    "varlen_needs_document_masking": (["model.attn_implementation=varlen", "data.document_masking=false"],
                                      "runs attention per document, from the boundaries data.document_masking"),
    "some_data": (["data.path=null"], "No training data: set data.path to a prepared folder"),
    "min_lr_within_lr": (["optim.min_lr=0.01"], "optim.min_lr=0.01 must not exceed optim.lr=0.002."),
    "one_decay_length": (["schedule.decay_steps=30", "schedule.decay_fraction=0.1"],
                         "schedule.decay_steps=30 and schedule.decay_fraction=0.1 both set the length of the decay. Keep"),
    "decay_after_warmup": (["schedule.decay_steps=299"], "train.max_steps=300 leaves 298 steps after schedule.warmup_steps=2"),
    "whole_micro_batches": (["train.micro_batch_size=3"],
                            "train.global_batch_size=8 must be a multiple of train.micro_batch_size=3."),
    "ramp_whole_micro_batches": (["train.batch_ramp=[{step: 0, size: 6}, {step: 5, size: 8}]"],
                                 "step sizes (6) that are not multiples of train.micro_batch_size=4"),
    "muon_under_deepspeed_without_clipping": (["optim.name=muon", ZERO1], "Set optim.grad_clip=0"),
    "early_stopping_checkpoints_every_evaluation": (["train.early_stopping_patience=2", "checkpoint.every_steps=0"],
                                                    "must be a positive multiple of checkpoint.every_steps=0. Set "
                                                    "checkpoint.every_steps=100"),
    "tasks_with_the_validation": (["eval.tasks=[next_line]", "eval.every_steps=150"],
                                  "eval.every_steps=150 must be a multiple of train.eval_every_steps=100: the tasks are "
                                  "scored with the validation. Set eval.every_steps=100, or null"),
    "branch_resumes_its_own": (["checkpoint.branch_from=runs/a", "checkpoint.resume=none"],
                               "Set checkpoint.resume=auto, or checkpoint.branch_from=null"),
    "ema_export_needs_ema": (["checkpoint.export_weights=ema"], "checkpoint.export_weights=ema needs a weight EMA"),
    "spike_history_within_window": (["spike.window=10", "spike.min_history=20"],
                                    "spike.min_history=20 exceeds spike.window=10"),
    "profile_steps_in_order": (["profile.first_step=5", "profile.last_step=3"], "need 1 <= first_step <= last_step"),
    "profile_within_the_run": (["profile.first_step=400"], "profile.last_step=400 is beyond train.max_steps=300"),
    "sequence_parallel_needs_deepspeed": ([SP2], "runs through DeepSpeed (Ulysses): choose a DeepSpeed config"),
    "sequence_parallel_divides_heads": (["distributed.sequence_parallel_size=3", ZERO1, "data.seq_len=48"],
                                        "distributed.sequence_parallel_size=3 must divide the attention heads"),
    "sequence_parallel_divides_window": ([SP2, ZERO1, "data.seq_len=33"],
                                         "Choose a seq_len that is a multiple of 2."),
    "sequence_parallel_attention": ([SP2, ZERO1, "model.attn_implementation=eager"],
                                    "Use model.attn_implementation=sdpa, flash_attention_2 or flash_attention_3"),
    "sequence_parallel_without_tasks": ([SP2, ZERO1, "eval.tasks=[next_line]"],
                                        "is not supported with distributed.sequence_parallel_size=2"),
    "sequence_parallel_without_samples": ([SP2, ZERO1, 'eval.samples=["def "]'], "a prompt is not split over the group"),
    "sequence_parallel_without_layer_stats": ([SP2, ZERO1, "logging.layer_stats=true"],
                                              "Set logging.layer_stats=false (the global grad_norm is still logged)"),
    "tensor_parallel_needs_deepspeed": ([TP2], "runs through DeepSpeed AutoTP: choose a DeepSpeed config with ZeRO 0-2"),
    "tensor_parallel_divides_model": ([TP2, ZERO1, "model.intermediate_size=129"],
                                      "and model.intermediate_size=129: each rank holds an equal share"),
    "tensor_parallel_without_sequence_parallel": ([TP2, SP2, ZERO1], "Choose one of the two splits"),
    "tensor_parallel_without_ema": ([TP2, ZERO1, "train.ema_decay=0.99"], "with train.ema_decay=0.99 in this recipe"),
    "tensor_parallel_without_tasks": ([TP2, ZERO1, "eval.tasks=[next_line]"], "Choose eval.tasks=[] and score the export"),
    "tensor_parallel_without_samples": ([TP2, ZERO1, 'eval.samples=["def "]'], "Choose eval.samples=[] and continue"),
    "tensor_parallel_without_muon": ([TP2, ZERO1, "optim.name=muon", "optim.grad_clip=0"], "Choose optim.name=adamw"),
    "tensor_parallel_without_fp8": ([TP2, ZERO1, "train.precision=fp8"], "Choose train.precision=bf16"),
    "tensor_parallel_without_compile": ([TP2, ZERO1, "train.compile=layers"],
                                        "cannot be combined with train.compile=layers in this recipe. Choose "
                                        "train.compile=none, or set distributed.tensor_parallel_size=1."),
    "tensor_parallel_without_layer_stats": ([TP2, ZERO1, "logging.layer_stats=true"],
                                            "cannot be combined with logging.layer_stats=true in this recipe"),
}


def _unchecked(monkeypatch, overrides: list[str]) -> Config:
    """The tiny recipe with ``overrides``, every section valid, its rules not checked."""
    with monkeypatch.context() as patch:
        patch.setattr(config_loader, "check_rules", lambda cfg: None)
        return load_config(TINY, [*TINY_OVERRIDES, *overrides])


def _broken(cfg: Config) -> list[str]:
    return [rule.name for rule in RULES if rule.applies(cfg)]


def test_every_rule_has_a_trigger_and_a_unique_name():
    names = [rule.name for rule in RULES]
    assert len(set(names)) == len(names)
    assert set(names) == {*TRIGGERS, "one_data_choice"}  # one_data_choice: test_both_data_choices_are_refused
    assert _broken(load_config(TINY, TINY_OVERRIDES)) == []


@pytest.mark.parametrize("name", list(TRIGGERS))
def test_each_rule_fires_alone_with_its_message(name, monkeypatch):
    overrides, fragment = TRIGGERS[name]
    cfg = _unchecked(monkeypatch, overrides)
    assert _broken(cfg) == [name]
    with pytest.raises(UserError) as err:
        check_rules(cfg)
    assert fragment in str(err.value) and err.value.exit_code == 2
    with pytest.raises(UserError) as loaded:
        load_config(TINY, [*TINY_OVERRIDES, *overrides])
    assert str(loaded.value) == str(err.value)


def test_both_data_choices_are_refused():
    data = load_config(TINY, TINY_OVERRIDES).to_dict()
    data["data"]["sources"] = [{"path": "data/code"}]
    with pytest.raises(UserError, match="data.path='data/stdlib' and data.sources are both set.* set data.path=null"):
        config_from_dict(data)


def test_every_broken_rule_is_reported_at_once():
    with pytest.raises(UserError) as err:
        load_config(TINY, [*TINY_OVERRIDES, TP2, "train.compile=true", "train.precision=fp8", "optim.min_lr=1"])
    lines = str(err.value).splitlines()
    assert lines[0] == "4 settings of this recipe cannot be combined:" and len(lines) == 5
    assert [line.split(" ")[1] for line in lines[1:]] == [
        "optim.min_lr=1.0", "distributed.tensor_parallel_size=2", "distributed.tensor_parallel_size=2",
        "distributed.tensor_parallel_size=2"]


# --- Components take their own section

WHOLE_CONFIG_LIMIT = 10
"""Functions and constructors in lmrecipe/ that may take the whole Config (top-level builders, the config's own)."""


def _names_config(annotation: ast.expr | None) -> bool:
    """Whether an annotation is ``Config``, optionally with None (``Config | None``, ``Optional[Config]``); a
    ``Callable[[Config], bool]`` is a function, not a Config."""
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        annotation = ast.parse(annotation.value, mode="eval").body
    if isinstance(annotation, ast.Name):
        return annotation.id == "Config"
    if isinstance(annotation, ast.BinOp):  # X | Y
        return _names_config(annotation.left) or _names_config(annotation.right)
    if isinstance(annotation, ast.Subscript) and ast.unparse(annotation.value).split(".")[-1] in ("Optional", "Union"):
        items = annotation.slice.elts if isinstance(annotation.slice, ast.Tuple) else [annotation.slice]
        return any(_names_config(item) for item in items)
    return False


def whole_config_parameters(package: Path = ROOT / "lmrecipe") -> list[str]:
    """``file:line name`` of every function with a parameter annotated ``Config`` and every dataclass field of that
    type (a constructor parameter)."""
    found = []
    for path in sorted(package.rglob("*.py")):
        where = path.relative_to(package.parent)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                params = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
                if any(_names_config(p.annotation) for p in params):
                    found.append(f"{where}:{node.lineno} {node.name}")
            elif isinstance(node, ast.ClassDef) and any("dataclass" in ast.unparse(d) for d in node.decorator_list):
                found += [f"{where}:{item.lineno} {node.name}.{item.target.id}" for item in node.body
                          if isinstance(item, ast.AnnAssign) and _names_config(item.annotation)]
    return found


def test_few_functions_take_the_whole_config():
    found = whole_config_parameters()
    assert len(found) <= WHOLE_CONFIG_LIMIT, f"{len(found)} take the whole Config:\n" + "\n".join(found)


def test_the_counter_sees_functions_methods_and_dataclass_fields(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text(
        "@dataclass\nclass Run:\n    cfg: Config\n    step: int\n\n"
        "class Loop:\n    def __init__(self, cfg: 'Config | None'):\n        pass\n\n"
        "def build(train: TrainConfig, rule: Callable[[Config], bool], *, cfg: Optional[Config] = None):\n    pass\n")
    assert set(whole_config_parameters(tmp_path / "pkg")) == {"pkg/a.py:3 Run.cfg", "pkg/a.py:7 __init__", "pkg/a.py:10 build"}
    assert _names_config(ast.parse("x: Optional[Config]").body[0].annotation)
    for other in ("TrainConfig", "Callable[[Config], bool]", "list[Config]"):
        assert not _names_config(ast.parse(f"x: {other}").body[0].annotation), other


def test_every_config_field_has_a_docstring():
    undocumented = []

    def visit(cls: type) -> None:
        source = ast.parse(__import__("inspect").getsource(cls)).body[0]
        body = source.body
        for i, item in enumerate(body):
            if isinstance(item, ast.AnnAssign):
                following = body[i + 1] if i + 1 < len(body) else None
                if not (isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)):
                    undocumented.append(f"{cls.__name__}.{item.target.id}")
        for hint in typing.get_type_hints(cls).values():
            for inner in (hint, *typing.get_args(hint)):
                if dataclasses.is_dataclass(inner):
                    visit(inner)

    visit(Config)
    assert not undocumented, undocumented


# --- flash_attention_3: a choice of the config, refused at start-up only where it cannot run

def test_flash_attention_3_is_a_choice_of_the_config():
    assert load_config(TINY, ["model.attn_implementation=flash_attention_3"]).model.attn_implementation == "flash_attention_3"
    with pytest.raises(UserError, match="Choose one of: sdpa, eager, flash_attention_2, flash_attention_3"):
        load_config(TINY, ["model.attn_implementation=flash_attention_4"])


@pytest.fixture
def machine(monkeypatch):
    """``machine(cuda, installed)``: this process sees a CUDA device or not, and only the modules ``installed``."""
    from lmrecipe.model import attention

    def pretend(cuda: bool, installed: set[str]) -> None:
        monkeypatch.setattr("torch.cuda.is_available", lambda: cuda)
        monkeypatch.setattr(attention, "_installed", lambda module: module in installed)

    return pretend


@pytest.mark.parametrize("document_masking", [True, False])
@pytest.mark.parametrize("cuda, installed, reason", [
    (False, {"flash_attn_interface"}, "needs a CUDA GPU and this machine has none"),
    (True, set(), "needs the flash-attn-3 package (module flash_attn_interface), which is not installed"),
])
def test_flash_attention_3_is_refused_at_start_up_where_it_cannot_run(machine, document_masking, cuda, installed,
                                                                      reason):
    from lmrecipe.model.build import build_attention

    machine(cuda, installed)
    cfg = load_config(TINY, ["model.attn_implementation=flash_attention_3", f"data.document_masking={document_masking}"])
    with pytest.raises(UserError) as caught:
        build_attention(cfg.model, cfg.data, hf_config=None)  # refused before the model's config is read
    message = " ".join(str(caught.value).split())
    assert reason in message and "set model.attn_implementation=sdpa" in message


@pytest.mark.parametrize("installed", [{"flash_attn_interface"}, {"kernels"}])
def test_flash_attention_3_starts_where_its_kernel_can_load(machine, installed):
    from lmrecipe.model.build import build_attention

    machine(True, installed)
    cfg = load_config(TINY, ["model.attn_implementation=flash_attention_3", "data.document_masking=false"])
    assert build_attention(cfg.model, cfg.data, hf_config=None) is None  # plain causal attention: transformers' own
