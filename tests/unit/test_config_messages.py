"""Config messages: the example an error shows is a value of the key it names; a note names each stage or batch-size
ramp point that a run ends before (the dry run's note is tested in test_cli_flags.py, the start-up warning in
test_batch_ramp.py)."""

from __future__ import annotations

import re
import typing

import pytest
import yaml
from helpers import ROOT

from lmrecipe.config import Config, load_config
from lmrecipe.config import loader as config_loader
from lmrecipe.config.notes import unreached_steps
from lmrecipe.config.reference import ITEMS, config_keys
from lmrecipe.errors import UserError

TINY = ROOT / "recipes" / "tiny.yaml"
LIST_AND_MAPPING_KEYS = [k.key for k in config_keys() if k.type == "mapping" or k.type.startswith("list")]
"""The keys whose values are lists or mappings, a list item's keys among them (``data.stages[].weights``)."""
SOURCES = "data.sources=[{path: data/web, name: web}, {path: data/code, name: code}]"


def wrong_override(key: str) -> str:
    """An override that gives ``key`` a value of the wrong kind: a number, or a list item without its keys."""
    if key.endswith("[]"):
        return f"{key[:-2]}=[{{}}]"
    list_key, _, name = key.partition("[].")
    return f"{list_key}=[{{{name}: 3}}]" if name else f"{key}=3"


def shown_example(override: str) -> str:
    with pytest.raises(UserError) as err:
        load_config(TINY, [override])
    found = re.search(r"e\.g\. (?:[\w.\[\]]+=')?(.*?)'?\.$", str(err.value))
    assert found, f"{override}: the message shows no example: {err.value}"
    return found[1]


def type_of(key: str) -> typing.Any:
    hint: typing.Any = Config
    for part in key.split("."):
        hint = typing.get_type_hints(hint)[part.removesuffix("[]")]
        if part.endswith("[]"):
            hint = typing.get_args(hint)[0]
    return hint


@pytest.mark.parametrize("key", [*LIST_AND_MAPPING_KEYS, *(f"{key}[]" for key in ITEMS)])
def test_a_value_of_the_wrong_kind_is_shown_an_example_of_its_own_key(key):
    example = yaml.safe_load(shown_example(wrong_override(key)))
    problems: list[str] = []
    config_loader._coerce(key, example, type_of(key), False, problems)  # raises on a key the example does not have
    assert problems == []


@pytest.mark.parametrize(("override", "into", "supporting"), [
    ("data.stages=3", "data.stages={}", [SOURCES]),
    ("data.stages=[{start_step: 0, weights: 3}]", "data.stages=[{{start_step: 0, weights: {}}}]", [SOURCES]),
    ("data.stages=[{weights: {web: 1}}]", "data.stages=[{{start_step: 0, weights: {{web: 1}}}}, {}]", [SOURCES]),
    ("train.batch_ramp=3", "train.batch_ramp={}", ["train.global_batch_size=128"]),
    ("train.batch_ramp=[{step: 0}]", "train.batch_ramp=[{{step: 0, size: 128}}, {}]", ["train.global_batch_size=128"]),
])
def test_the_examples_of_stages_and_ramps_load_as_those_keys(override, into, supporting):
    example = shown_example(override)
    assert "path:" not in example and "rms_norm_eps" not in example
    load_config(TINY, [*supporting, into.format(example)])


LINEAR = ["train.global_batch_size=32", "train.batch_ramp_start_size=8", "train.batch_ramp_increment=8",
          "train.batch_ramp_steps_per_increment=100"]


def test_a_linear_ramp_that_reaches_its_full_size_past_the_last_step_is_noted():
    cfg = load_config(TINY, ["train.max_steps=300", *LINEAR])  # sizes 8, 16, 24 from steps 0, 100, 200; 32 from 300
    assert unreached_steps(cfg.data, cfg.train) == [
        "The linear batch-size ramp (train.batch_ramp_start_size=8, train.batch_ramp_increment=8, "
        "train.batch_ramp_steps_per_increment=100) reaches train.global_batch_size only at step 300, at or after "
        "train.max_steps=300 (the last optimizer step is 299): its sizes from step 300 on never take effect, and the "
        "run ends at 24 sequences per step, below train.global_batch_size=32. Raise train.max_steps above 300 to reach "
        "the full size."]
    cfg = load_config(TINY, ["train.max_steps=301", *LINEAR])
    assert unreached_steps(cfg.data, cfg.train) == []


def test_every_stage_past_the_last_step_is_named_in_one_note():
    cfg = load_config(TINY, ["train.max_steps=100", SOURCES, "data.stages=[{start_step: 0, weights: {web: 1}}, "
                             "{start_step: 99, weights: {code: 1}}, {start_step: 100, weights: {web: 1}}, "
                             "{start_step: 5000, weights: {code: 1}}]"])
    assert unreached_steps(cfg.data, cfg.train) == [
        "data.stages[2] (start_step 100), data.stages[3] (start_step 5000) start at or after train.max_steps=100 (the "
        "last optimizer step is 99), so they never take effect: the run trains on data.stages[1]'s weights to its end. "
        "Raise train.max_steps above 5000 to train every stage."]
