"""Loading a run's configuration: dataclass defaults < recipe YAML < ``key=value`` overrides (dotted keys, e.g.
``optim.lr=3e-4``).

A recipe may start from another one: ``base: llama_1b.yaml`` (a path relative to the recipe's folder; a base may
name its own base; a cycle is an error). Each recipe is a layer over its base: sections merge key by key, and a
value (a list such as ``data.sources``, the mapping ``model.extra``) is replaced whole. Unknown keys and wrong types
are collected over every layer and reported together, each naming the key and the valid choices; then every
section's own checks, then the cross-field rules of ``rules.py``, each kind all at once (UserError, exit code 2).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from lmrecipe.config.rules import check_rules
from lmrecipe.config.sections import Config, DataConfig, fail_all
from lmrecipe.errors import UserError, fail
from lmrecipe.fileio import write_text_atomic

BASE_KEY = "base"
"""The recipe key naming the recipe it starts from."""

RENAMED = {"logging.tracker": "logging.trackers, a list: logging.trackers=[wandb] or [wandb,tensorboard]"}
"""Keys of earlier versions and what replaced them."""


EXAMPLES = {
    "model.extra": "{rms_norm_eps: 1e-5}",
    "data.sources": "[{path: data/code, weight: 0.7}, {path: data/prose, weight: 0.3}]",
    "data.sources[]": "{path: data/code, weight: 0.7}",
    "data.stages": "[{start_step: 0, weights: {web: 1.0}}, {start_step: 9000, weights: {web: 0.5, code: 0.5}}]",
    "data.stages[]": "{start_step: 9000, weights: {web: 0.5, code: 0.5}}",
    "data.stages[].weights": "{web: 0.5, code: 0.5}",
    "train.batch_ramp": "[{step: 0, size: 64}, {step: 500, size: 128}]",
    "train.batch_ramp[]": "{step: 500, size: 128}",
    "eval.tasks": "[next_line]",
    "eval.samples": '["def main(", "import "]',
    "logging.trackers": "[wandb, tensorboard]",
}
"""An example value of each list and mapping key (a list's items as ``key[]``), shown when a value is not of its type."""

BOOLEAN_WORDS = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}
"""How a boolean may be written on the command line (YAML reads its own)."""


class _Reported(Exception):
    """A value whose problems are already in the list: skip it without adding another."""


def load_config(recipe_path: str | os.PathLike | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Defaults < recipe YAML (after the recipes it names as ``base``) < ``key=value`` overrides, type-checked and
    validated; UserError listing every problem of a kind at once."""
    cfg = Config()
    problems: list[str] = []
    if recipe_path is not None:
        chain = _recipe_chain(Path(recipe_path))
        for path, data in chain:
            found: list[str] = []
            _merge(cfg, data, "", found, extra_names=(BASE_KEY,))
            section = data.get("data")
            _choose_data(cfg.data, set(section) if isinstance(section, dict) else set(), f"recipe {path}", found)
            where = "" if path == chain[-1][0] else f"In {path} (a base of {chain[-1][0]}): "
            problems += [where + problem for problem in found]
    cli_keys = set()
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            problems.append(f"Override {item!r} must look like key=value, e.g. optim.lr=3e-4.")
            continue
        _set_dotted(cfg, key.strip(), raw.strip(), problems)
        cli_keys.add(key.strip())
    _choose_data(cfg.data, {k.partition(".")[2] for k in cli_keys if k.startswith("data.")}, "command line", problems)
    if problems:
        raise fail_all(problems)
    cfg.validate()
    check_rules(cfg)
    return cfg


def config_from_dict(data: dict) -> Config:
    """Rebuild a Config from ``to_dict()`` output (e.g. a resolved config saved in a run folder)."""
    cfg = Config()
    problems: list[str] = []
    _merge(cfg, data, "", problems)
    if problems:
        raise fail_all(problems)
    cfg.validate()
    check_rules(cfg)
    return cfg


def config_yaml(cfg: Config) -> str:
    """The resolved config as YAML, every value written out (it names no base): what ``out_dir/config.yaml`` holds."""
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)


def save_config(cfg: Config, path: str | os.PathLike) -> None:
    """Write :func:`config_yaml` to ``path``, atomically."""
    write_text_atomic(path, config_yaml(cfg))


def _recipe_chain(path: Path) -> list[tuple[Path, dict]]:
    """The recipe and the recipes it names as ``base``, each with its mapping (``base`` removed), base first."""
    chain: list[tuple[Path, dict]] = []
    while True:
        data = _read_recipe(path, chain[-1][0] if chain else None)
        chain.append((path, data))
        base = data.pop(BASE_KEY, None)
        if base is None:
            return chain[::-1]
        if not isinstance(base, str) or not base.strip():
            raise fail(f"Recipe {str(path)!r} has base: {base!r}; name another recipe YAML, relative to the recipe's "
                       "folder (e.g. base: llama_1b.yaml).")
        following = Path(base) if Path(base).is_absolute() else path.parent / base
        if any(following.resolve() == seen.resolve() for seen, _ in chain):
            cycle = " -> ".join(str(p) for p in [*(seen for seen, _ in chain), following])
            raise fail(f"The recipes' base: keys form a cycle ({cycle}). Remove the base: key that closes it.")
        path = following


def _read_recipe(path: Path, child: Path | None) -> dict:
    """One recipe file's mapping; UserError naming the file (and the recipe that named it as its base)."""
    if child is None:
        named, fix = f"Recipe {str(path)!r}", "Pass a YAML file such as recipes/tiny.yaml."
    else:
        named = f"Recipe {str(child)!r} names base {str(path)!r}, which"
        fix = f"Name a recipe YAML file, relative to the recipe's folder ({child.parent}/), e.g. base: llama_1b.yaml."
    if path.is_dir():
        raise fail(f"{named} is a folder, not a file. {fix}")
    if not path.is_file():
        raise fail(f"{named} does not exist. {fix}")
    try:
        with open(path) as stream:  # from the stream, PyYAML's marks name the file, its line and its column
            data = yaml.safe_load(stream)
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        raise fail(f"Recipe {str(path)!r} is not valid YAML: {err}") from None
    if data is None:  # an empty file would train the full default model without a word
        raise fail(f"Recipe {str(path)!r} is empty. Write its sections (model:, data:, train:, ...) or start from "
                   "a recipe such as recipes/tiny.yaml.")
    if not isinstance(data, dict):
        raise fail(f"Recipe {str(path)!r} must hold a mapping of sections (model:, data:, ...).")
    return data


def _choose_data(data: DataConfig, keys: set[str], layer: str, problems: list[str]) -> None:
    """``data.path`` and ``data.sources`` are one choice: the layer that sets one clears the other."""
    if "sources" in keys and "path" in keys and data.sources and data.path is not None:
        problems.append(f"The {layer} sets both data.path and data.sources: keep one (a single folder, or the mixture).")
    elif "sources" in keys and data.sources and "path" not in keys:
        data.path = None
    elif "path" in keys and data.path is not None and "sources" not in keys:
        data.sources = []


def _merge(obj: Any, data: dict, prefix: str, problems: list[str], extra_names: tuple[str, ...] = ()) -> None:
    """Set every key of ``data`` on the dataclass ``obj``; each problem goes to ``problems`` and the rest go on."""
    for key, value in data.items():
        try:
            _set_value(obj, str(key), value, prefix, False, problems, extra_names)
        except UserError as err:
            problems.append(str(err))
        except _Reported:
            pass


def _set_dotted(root: Any, dotted: str, raw: str, problems: list[str]) -> None:
    """One ``key=value`` override on the dataclass ``root``."""
    parts = dotted.split(".")
    obj: Any = root
    prefix = ""
    try:
        for part in parts[:-1]:
            _check_name(part, _field_names(obj), prefix)
            obj = getattr(obj, part)
            if not dataclasses.is_dataclass(obj):
                raise fail(f"{prefix}{part} is a value, not a section: write {prefix}{part}=VALUE.")
            prefix += part + "."
        _set_value(obj, parts[-1], raw, prefix, True, problems)
    except UserError as err:
        problems.append(str(err))
    except _Reported:
        pass


def _field_names(obj: Any) -> list[str]:
    return [f.name for f in dataclasses.fields(obj)]


def _check_name(key: str, names: list[str], prefix: str, extra_names: tuple[str, ...] = ()) -> None:
    """UserError unless ``key`` is one of ``names``: names the closest valid key and lists them all (``prefix``ed)."""
    if key not in names:
        if prefix + key in RENAMED:
            raise fail(f"{prefix}{key} was replaced by {RENAMED[prefix + key]}.")
        close = difflib.get_close_matches(key, [*names, *extra_names], n=1)
        hint = f" Did you mean {prefix}{close[0]}?" if close else ""
        raise fail(f"Unknown config key {prefix}{key}.{hint} Valid keys here: {', '.join(prefix + n for n in names)}.")


def _set_value(obj: Any, key: str, value: Any, prefix: str, from_cli: bool, problems: list[str],
               extra_names: tuple[str, ...] = ()) -> None:
    _check_name(key, _field_names(obj), prefix, extra_names)
    current = getattr(obj, key)
    full = prefix + key
    if dataclasses.is_dataclass(current):
        if from_cli:
            raise fail(f"{full} is a section; set one of its keys, e.g. {full}.<key>=VALUE.")
        if not isinstance(value, dict):
            raise fail(f"{full} must be a mapping of keys, got {value!r}.")
        _merge(current, value, full + ".", problems)
        return
    hint = typing.get_type_hints(type(obj))[key]
    from_bool = obj.__dataclass_fields__[key].metadata.get("from_bool")
    if from_bool is not None and _is_boolean(value):  # a choice that was a switch: its old values still load
        value = from_bool[_coerce(full, value, bool, from_cli, problems)]
    setattr(obj, key, _coerce(full, value, hint, from_cli, problems))


def _is_boolean(value: Any) -> bool:
    return isinstance(value, bool) or isinstance(value, str) and value.lower() in BOOLEAN_WORDS


def _coerce(key: str, value: Any, hint: Any, from_cli: bool, problems: list[str]) -> Any:
    """Return ``value`` as type ``hint`` or raise a UserError naming the key and the allowed values (the items of a
    list are checked one by one, their problems added to ``problems``)."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType) and type(None) in args:
        if value is None or (isinstance(value, str) and value.lower() in ("null", "none", "~")):
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(key, value, inner[0], from_cli, problems)
    if origin is Literal:
        if isinstance(value, str) and value in args:
            return value
        raise fail(f"{key}={value!r} is not allowed. Choose one of: {', '.join(map(str, args))}.")
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in BOOLEAN_WORDS:
            return BOOLEAN_WORDS[value.lower()]
        raise fail(f"{key}={value!r} must be a boolean (true or false).")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return int(value.replace("_", ""))
            except ValueError:
                pass
        raise fail(f"{key}={value!r} must be an integer.")
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise fail(f"{key}={value!r} must be a number.")
    if hint is str:
        if isinstance(value, str):
            return value
        if from_cli or isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise fail(f"{key}={value!r} must be a string.")
    if origin is list:
        return _coerce_list(key, value, args[0], from_cli, problems)
    if dataclasses.is_dataclass(hint):
        return _record(key, value, hint, problems)
    if hint is dict or origin is dict:
        if isinstance(value, str) and from_cli:
            try:
                value = yaml.safe_load(value)
            except yaml.YAMLError:
                value = None
        if isinstance(value, dict):
            return value
        raise fail(f"{key}={value!r} must be a mapping{_example(key)}.")
    raise UserError(f"{key}: unsupported config type {hint!r}.")


def _coerce_list(key: str, value: Any, item_hint: Any, from_cli: bool, problems: list[str]) -> list:
    if isinstance(value, str) and from_cli:
        try:
            value = yaml.safe_load(value)
        except yaml.YAMLError as err:
            raise fail(f"{key}={value!r} is not valid YAML ({err}).") from None
    if value is None:
        value = []
    if isinstance(value, str):
        value = [value]  # one item
    if not isinstance(value, list):
        raise fail(f"{key}={value!r} must be a list{_example(key)}.")
    before = len(problems)
    items = []
    for i, item in enumerate(value):
        try:
            items.append(_coerce(f"{key}[{i}]", item, item_hint, False, problems))
        except UserError as err:
            problems.append(str(err))
        except _Reported:
            pass
    if len(problems) > before:
        raise _Reported()
    return items


def _record(key: str, value: Any, cls: type, problems: list[str]) -> Any:
    """A list item such as a :class:`DataSource` from a mapping, with the same strict key and type checks."""
    if isinstance(value, cls):
        return value
    names = _field_names(cls)
    required = [f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if not isinstance(value, dict):
        raise fail(f"{key}={value!r} must be a mapping with keys {', '.join(names)} (required: {', '.join(required)})"
                   f"{_example(key)}.")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    before = len(problems)
    for name, item in value.items():
        name = str(name)
        try:
            _check_name(name, names, f"{key}.")
            kwargs[name] = _coerce(f"{key}.{name}", item, hints[name], False, problems)
        except UserError as err:
            problems.append(str(err))
    if len(problems) > before:
        raise _Reported()
    missing = [name for name in required if name not in kwargs]
    if missing:
        raise fail(f"{key} lacks {', '.join(missing)}{_example(key, ': write e.g. ')}.")
    return cls(**kwargs)


def _example(key: str, lead: str = ", e.g. ") -> str:
    """``lead`` and the example of ``key`` from :data:`EXAMPLES` ('' for none): an override ``KEY='VALUE'``, or the
    value alone inside a list item (``data.stages[0]``, which no override sets by itself)."""
    example = EXAMPLES.get(re.sub(r"\[\d+\]", "[]", key))
    if example is None:
        return ""
    return lead + (example if "[" in key else f"{key}='{example}'")
