"""The key reference (``docs/reference/keys.md``) is generated from the config dataclasses and kept in step with them."""

from __future__ import annotations

import dataclasses
import typing
from typing import Literal, Optional

from helpers import ROOT

from lmrecipe.config import Config, fixed_on_resume_keys
from lmrecipe.config import reference
from lmrecipe.config.reference import (
    REGENERATE,
    config_keys,
    first_sentence,
    render_markdown,
    type_name,
    undocumented_fields,
)

PAGE = ROOT / "docs" / "reference" / "keys.md"


def dataclass_keys(cls: type = Config, prefix: str = "") -> list[str]:
    """Every field of the config's dataclasses as a dotted key, found independently of the generator."""
    keys = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            keys += dataclass_keys(hint, f"{prefix}{f.name}.")
            continue
        keys.append(prefix + f.name)
        items = [a for a in typing.get_args(hint) if dataclasses.is_dataclass(a)]
        for item in items:
            keys += dataclass_keys(item, f"{prefix}{f.name}[].")
    return keys


def test_the_checked_in_page_is_what_the_generator_writes():
    expected = render_markdown()
    actual = PAGE.read_text() if PAGE.is_file() else ""
    assert actual == expected, (f"{PAGE.relative_to(ROOT)} is out of date with lmrecipe/config/sections/; "
                                f"regenerate it with: {REGENERATE}")


def test_every_dataclass_field_is_a_key_of_the_page():
    expected = dataclass_keys()
    assert [k.key for k in config_keys()] == expected
    page = PAGE.read_text()
    assert [key for key in expected if f"| `{key}` |" not in page] == []


def test_every_field_has_a_docstring():
    missing = undocumented_fields()
    assert not missing, (f"config fields without a docstring: {', '.join(missing)}. Write one on the line after each "
                         f"field (units, what null means), then run {REGENERATE}.")


def test_a_field_without_a_docstring_is_named(monkeypatch):
    docs = dict(reference.field_docs())
    del docs[("TrainConfig", "max_steps")]
    monkeypatch.setattr(reference, "field_docs", lambda: docs)
    assert undocumented_fields() == ["TrainConfig.max_steps"]


def test_fixed_on_resume_keys_are_marked():
    marked = [k.key for k in config_keys() if k.fixed_on_resume]
    assert marked == fixed_on_resume_keys() and "data.seq_len" in marked
    assert "| `data.seq_len` | int | `256` | **fixed** Tokens per training sequence" in PAGE.read_text()


def test_types_and_defaults_read_as_a_recipe_writes_them():
    assert type_name(int) == "int"
    assert type_name(Optional[float]) == "float | null"
    assert type_name(Literal["sdpa", "eager"]) == "one of sdpa, eager"
    assert type_name(list[str]) == "list[str]"
    keys = {k.key: k for k in config_keys()}
    assert (keys["model.num_kv_heads"].type, keys["model.num_kv_heads"].default) == ("int | null", "null")
    assert keys["model.attn_implementation"].type == ("one of sdpa, eager, flash_attention_2, flash_attention_3, varlen, "
                                                      "flex_attention")
    assert (keys["logging.trackers"].default, keys["train.compile"].default) == ("[]", "none")
    assert keys["train.compile"].type == "one of none, model, layers"
    assert keys["data.sources[].path"].default == "required"
    assert keys["out_dir"].section == "" and keys["optim.lr"].doc.startswith("Peak learning rate")


def test_the_first_sentence_does_not_stop_at_an_abbreviation():
    assert first_sentence("Extra kwargs (e.g. ``rms_norm_eps``). More here.") == "Extra kwargs (e.g. ``rms_norm_eps``)."
    assert first_sentence("No period") == "No period"
