"""The key reference, generated from the config dataclasses: every key with its type, default, whether a resume
may change it, and its docstring (read from the source of the modules that declare them, so the reference cannot
drift from the code).

:func:`config_keys` lists the keys; :func:`render_markdown` is ``docs/reference/keys.md``, regenerated with
``python -m lmrecipe.config.reference > docs/reference/keys.md``; :func:`format_key_list` is ``train.py
--list-keys``; :func:`check_no_flags` turns a ``--max_steps 10`` on the command line into the ``key=value`` it meant.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import re
import sys
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal, Sequence

from lmrecipe.config.loader import BASE_KEY
from lmrecipe.config.sections import BatchSize, Config, DataSource, DataStage
from lmrecipe.errors import UserError

REGENERATE = "python -m lmrecipe.config.reference > docs/reference/keys.md"
"""The command that writes the checked-in key reference."""

ITEMS = {"data.sources": DataSource, "data.stages": DataStage, "train.batch_ramp": BatchSize}
"""List keys whose items are mappings of their own keys (documented as ``data.sources[].path``, ...)."""

HF_NAMES = {
    "learning_rate": "optim.lr", "output_dir": "out_dir", "per_device_train_batch_size": "train.micro_batch_size",
    "max_grad_norm": "optim.grad_clip", "adam_beta1": "optim.beta1", "adam_beta2": "optim.beta2",
    "adam_epsilon": "optim.eps", "logging_steps": "logging.log_every_steps", "eval_steps": "train.eval_every_steps",
    "save_steps": "checkpoint.every_steps", "save_total_limit": "checkpoint.keep_last",
    "lr_scheduler_type": "schedule.decay", "resume_from_checkpoint": "checkpoint.resume", "bf16": "train.precision",
    "fp16": "train.precision", "torch_compile": "train.compile", "report_to": "logging.trackers",
    "deepspeed": "distributed.deepspeed_config", "max_seq_length": "data.seq_len", "block_size": "data.seq_len",
}
"""Hugging Face ``TrainingArguments`` names whose last component matches no key here, and the key that does their job."""
HF_SWITCHES = {"bf16": "bf16", "fp16": "fp16"}
"""Hugging Face switches that stand for a value of their key (``--bf16``: ``train.precision=bf16``)."""


@dataclass(frozen=True)
class KeyInfo:
    """One configuration key as the reference shows it."""

    key: str
    """Dotted key as written in overrides (``train.max_steps``; ``data.sources[].path`` for a list item's key)."""
    section: str
    """The section it belongs to (``""`` for a top-level key such as ``out_dir``)."""
    type: str
    """Readable type: ``int``, ``float | null``, ``one of sdpa, eager, ...``, ``list[str]``."""
    default: str
    """The default as YAML would write it (``null``, ``true``, ``[]``); ``required`` when there is none."""
    fixed_on_resume: bool
    doc: str
    """The field's docstring as one paragraph ('' when the field has none)."""

    def first_sentence(self) -> str:
        return first_sentence(self.doc)


@functools.cache
def field_docs() -> dict[tuple[str, str], str]:
    """``{(class name, field name): docstring}`` of every dataclass of the configuration, read once from the source
    of each module that declares one (an attribute docstring is the string literal right after the field)."""
    docs = {}
    for module in dict.fromkeys(sys.modules[cls.__module__] for cls in _config_classes()):
        for node in ast.parse(inspect.getsource(module)).body:
            if isinstance(node, ast.ClassDef):
                docs.update(_attribute_docs(node))
    return docs


def _attribute_docs(node: ast.ClassDef) -> dict[tuple[str, str], str]:
    docs = {}
    for item, following in zip(node.body, [*node.body[1:], None]):
        if (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
                and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)):
            docs[(node.name, item.target.id)] = " ".join(inspect.cleandoc(following.value.value).split())
    return docs


def config_keys() -> list[KeyInfo]:
    """Every key of the configuration in declaration order: top-level keys, then each section's, each list item's
    keys after the list (:data:`ITEMS`)."""
    hints = typing.get_type_hints(Config)
    top = [f for f in dataclasses.fields(Config) if not dataclasses.is_dataclass(hints[f.name])]
    keys = [_key_info(Config, f, "", "") for f in top]
    for name in section_names():
        section_cls = hints[name]
        for f in dataclasses.fields(section_cls):
            info = _key_info(section_cls, f, name, f"{name}.")
            keys.append(info)
            for item in _items_of(info.key):
                keys.append(item)
    return keys


def section_names() -> list[str]:
    """The sections of :class:`Config`, in declaration order."""
    hints = typing.get_type_hints(Config)
    return [f.name for f in dataclasses.fields(Config) if dataclasses.is_dataclass(hints[f.name])]


def section_doc(name: str) -> str:
    return field_docs().get(("Config", name), "")


def undocumented_fields() -> list[str]:
    """``Class.field`` of every field of the config's dataclasses that has no docstring."""
    missing = []
    for cls in _config_classes():
        missing += [f"{cls.__name__}.{f.name}" for f in dataclasses.fields(cls)
                    if not field_docs().get((cls.__name__, f.name))]
    return missing


def _config_classes() -> list[type]:
    hints = typing.get_type_hints(Config)
    return [Config, *(hints[name] for name in section_names()), *ITEMS.values()]


def _items_of(list_key: str) -> list[KeyInfo]:
    cls = ITEMS.get(list_key)
    if cls is None:
        return []
    section = list_key.split(".")[0]
    return [_key_info(cls, f, section, f"{list_key}[].") for f in dataclasses.fields(cls)]


def _key_info(cls: type, f: dataclasses.Field, section: str, prefix: str) -> KeyInfo:
    hint = typing.get_type_hints(cls)[f.name]
    return KeyInfo(prefix + f.name, section, type_name(hint), _default(f), bool(f.metadata.get("fixed_on_resume")),
                   field_docs().get((cls.__name__, f.name), ""))


def type_name(hint: Any) -> str:
    """A type as a recipe author reads it: ``int``, ``float | null``, ``one of a, b``, ``list[str]``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        inner = [type_name(a) for a in args if a is not type(None)]
        return " | ".join(inner) + (" | null" if type(None) in args else "")
    if origin is Literal:
        return "one of " + ", ".join(map(str, args))
    if origin is list:
        item = args[0]
        if dataclasses.is_dataclass(item):
            return "list of mappings"
        if typing.get_origin(item) is Literal:
            return "list, each " + type_name(item)
        return f"list[{type_name(item)}]"
    if hint is dict or origin is dict:
        return "mapping"
    return getattr(hint, "__name__", str(hint))


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return yaml_value(f.default)
    if f.default_factory is not dataclasses.MISSING:
        return yaml_value(f.default_factory())
    return "required"


def yaml_value(value: Any) -> str:
    """A default as a recipe would write it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, dict)) and not value:
        return "[]" if isinstance(value, list) else "{}"
    return str(value)


_SENTENCE_END = re.compile(r"(?<!e\.g)(?<!i\.e)(?<!etc)\.(?=\s|$)")


def first_sentence(text: str) -> str:
    """The first sentence of a docstring (a period that ends ``e.g.`` or ``i.e.`` does not end it)."""
    match = _SENTENCE_END.search(text)
    return text[: match.end()] if match else text


# ------------------------------------------------------------------------------------------------ the Markdown page

_INTRO = f"""\
# Configuration keys

<!-- Generated from lmrecipe/config/sections/ by `{REGENERATE}`; do not edit by hand. -->

Every key a recipe may set, with its type, its default and what it does. This page is generated from the
configuration's dataclasses (`lmrecipe/config/sections/`, one docstring per field); after changing a field,
regenerate it with

    {REGENERATE}

(`tests/unit/test_key_reference.py` fails while the page and the code disagree).

A run's configuration is built in three layers, each over the one before: these defaults, then the recipe YAML, then
`key=value` overrides on the command line, with dotted keys:

    python train.py recipes/tiny.yaml train.max_steps=200 optim.lr=3e-4 logging.trackers=[tensorboard]

A recipe may start from another one with `{BASE_KEY}: other.yaml` (a path relative to the recipe's folder): its
sections merge key by key over the base's, and a list or a mapping (`data.sources`, `model.extra`) is replaced whole.
Unknown keys and wrong types are refused, every one at once, with the valid choices.
`python train.py --list-keys [SECTION]` prints this list in short, `python train.py --print-config RECIPE [overrides]`
the configuration a run would use, and `python train.py --dry-run RECIPE [overrides]` checks a run without training.

A key marked **fixed** is fixed on resume: the saved weights, shards or data position depend on it, so a run that
resumes from a checkpoint may not change it.
"""


def _cell(text: str) -> str:
    """Markdown table cell: RST double backticks as code spans, pipes escaped."""
    return text.replace("``", "`").replace("|", "\\|")


def _table(keys: list[KeyInfo]) -> list[str]:
    """A section's keys as a Markdown table, inside a ``key-table`` block: the site's stylesheet
    (docs/stylesheets/extra.css) keeps each key's name on one line there, where a table would break it mid-word."""
    lines = ['<div class="key-table" markdown>', "", "| Key | Type | Default | Description |", "| --- | --- | --- | --- |"]
    for info in keys:
        fixed = "**fixed** " if info.fixed_on_resume else ""
        lines.append(f"| `{info.key}` | {_cell(info.type)} | `{_cell(info.default)}` | {fixed}{_cell(info.doc)} |")
    return [*lines, "", "</div>"]


def render_markdown() -> str:
    """The key reference page (``docs/reference/keys.md``): the same text for the same code, on any machine."""
    keys = config_keys()
    lines = [_INTRO, "## Top-level keys", "", *_table([k for k in keys if not k.section]), ""]
    for name in section_names():
        lines += [f"## `{name}`", "", _cell(section_doc(name)), "", *_table([k for k in keys if k.section == name]), ""]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ train.py --list-keys

def format_key_list(sections: str | Sequence[str] | None = None) -> str:
    """Every key (or those of the sections named, in that order) with its default and the first sentence of its
    docstring, grouped by section; UserError naming the sections for an unknown one."""
    names = section_names()
    chosen = [sections] if isinstance(sections, str) else [s for s in sections or () if s]
    for section in chosen:
        if section not in names:
            close = difflib.get_close_matches(section, names, n=1)
            hint = f" Did you mean {close[0]}?" if close else ""
            raise UserError(f"--list-keys: there is no section {section!r}.{hint} The sections are {', '.join(names)} "
                            "(top-level keys such as out_dir are listed with no argument).")
    keys = config_keys()
    groups = [(name, [k for k in keys if k.section == name]) for name in (dict.fromkeys(chosen) or names)]
    if not chosen:
        groups.insert(0, ("", [k for k in keys if not k.section]))
    width = max(len(f"{k.key}={k.default}") for _, group in groups for k in group)
    lines = []
    for name, group in groups:
        title = f"{name}: {first_sentence(section_doc(name))}" if name else "top-level keys:"
        lines += [title.replace("``", "")]
        for k in group:
            doc = k.first_sentence().replace("``", "") + (" Fixed on resume." if k.fixed_on_resume else "")
            lines.append(f"  {f'{k.key}={k.default}':<{width}}  {doc}")
        lines.append("")
    lines.append("Set any of them as key=value after the recipe, e.g. train.max_steps=200; types and full "
                 "descriptions: docs/reference/keys.md.")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ --flag=value on the CLI

def check_no_flags(args: list[str], allowed: tuple[str, ...]) -> None:
    """UserError when ``args`` hold ``--name [value]`` options other than ``allowed``: the recipe takes
    ``key=value`` overrides, so each is spelled as the override it meant, every one in one message."""
    found = []
    recipe = next((arg for arg in args if arg.endswith((".yaml", ".yml")) and "=" not in arg), "RECIPE")
    for i, arg in enumerate(args):
        if not arg.startswith("-") or arg == "-" or _is_number(arg) or arg.split("=")[0] in allowed:
            continue
        name, sep, value = arg.lstrip("-").partition("=")
        if not sep and i + 1 < len(args) and _looks_like_value(args[i + 1]):
            value = args[i + 1]
        found.append((arg if sep else " ".join(filter(None, (arg, value))), _flag_hint(name, value, recipe)))
    rule = "settings are key=value overrides after the recipe, with dotted keys"
    if len(found) == 1:
        (written, hint), = found
        raise UserError(f"{written!r} is not an option of train.py: {rule}. {hint[0].upper()}{hint[1:]}")
    if found:
        lines = "\n".join(f"- {written!r}: {hint}" for written, hint in found)
        raise UserError(f"{len(found)} options that train.py does not take ({rule}, e.g. python train.py {recipe} "
                        f"train.max_steps=10):\n{lines}")


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _looks_like_value(text: str) -> bool:
    return (not text.startswith("-") or _is_number(text)) and "=" not in text and not text.endswith((".yaml", ".yml"))


def _flag_hint(name: str, value: str, recipe: str) -> str:
    """What to write instead of ``--name value``."""
    candidates = matching_keys(name)
    shown = value or _implied_value(name, candidates)
    if len(candidates) == 1:
        return (f"did you mean {candidates[0]}={shown}? Write it after the recipe: python train.py {recipe} "
                f"{candidates[0]}={shown}.")
    if candidates:
        listed = " or ".join(f"{key}={shown}" for key in candidates)
        return f"it matches several keys: {listed}; write the one you mean after the recipe."
    return (f"no key is named {name!r}; train.py --list-keys lists the keys, docs/reference/keys.md describes them "
            "(an override reads e.g. train.max_steps=10).")


def _implied_value(name: str, candidates: list[str]) -> str:
    """The value a switch without one stands for: ``--bf16`` is bf16, a boolean key's switch is true."""
    name = name.replace("-", "_")
    if name in HF_SWITCHES:
        return HF_SWITCHES[name]
    types = {k.key: k.type for k in config_keys()}
    return "true" if candidates and all(types.get(key) == "bool" for key in candidates) else "VALUE"


def matching_keys(name: str) -> list[str]:
    """The dotted keys a ``--name`` option may have meant: a key of that full name, else those whose last component
    is that name (``-`` read as ``_``), else the key of a Hugging Face ``TrainingArguments`` name, else the closest."""
    name = name.strip("-").replace("-", "_")
    keys = [k.key for k in config_keys() if "[]" not in k.key]
    if name in keys:
        return [name]
    last = [key for key in keys if key.split(".")[-1] == name]
    if last:
        return last
    if name in HF_NAMES:
        return [HF_NAMES[name]]
    tails = {key.split(".")[-1]: key for key in keys}
    return [tails[close] for close in difflib.get_close_matches(name, list(tails), n=1, cutoff=0.75)]


if __name__ == "__main__":
    sys.stdout.write(render_markdown())  # the generated page on stdout: `> docs/reference/keys.md` writes it
