"""Config schema: every recipe loads, precedence, strictness, and errors without tracebacks."""

from __future__ import annotations

import pytest
import yaml
from helpers import ROOT

from lmrecipe.config import Config, config_from_dict, load_config, save_config
from lmrecipe.data.batches import BatchLayout
from lmrecipe.errors import UserError

RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))


def test_recipes_exist():
    names = {p.stem for p in RECIPES}
    assert {"tiny", "llama_125m", "llama_1b", "llama3_8b_continued"} <= names


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_every_recipe_loads_and_round_trips(recipe, tmp_path):
    cfg = load_config(recipe)
    raw = yaml.safe_load(recipe.read_text())
    # Every value the recipe sets is what the config holds.
    for section, values in raw.items():
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
