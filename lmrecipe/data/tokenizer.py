"""Which tokenizer made a folder's token ids, and the one check that two folders, or records of them, share it.

A tokenizer's signature is what gives the ids their meaning and width: ``vocab_size``, ``eos_id`` and ``dtype``
(from a prepared folder's ``meta.json``) and the sha256 of its ``tokenizer.json``. Every place that pairs ids with
weights or with other ids compares signatures here: a resume (the checkpoint's record against the data),
``model.init_from`` and ``eval.py`` (a model folder against the data), a mixture (its sources) and a shard set (each
shard's ``meta.json`` against the set).

A model folder (one without ``meta.json``: an export, a downloaded model) may hold the ``tokenizer.json`` it was
published with, while ``tools/prepare_data.py --tokenizer MODEL`` re-saves it (the same tokenizer, other bytes when
the ``tokenizers`` version differs). When such a folder's file differs in bytes, the vocabularies decide: every id
both define must name the same token.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from lmrecipe.errors import fail

logger = logging.getLogger(__name__)

SIGNATURE_KEYS = ("vocab_size", "dtype", "eos_id", "tokenizer_sha256")
"""What a tokenizer signature holds; a key that one side does not know (None) is not compared."""
_LABELS = {"tokenizer_sha256": "tokenizer.json sha256"}


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 24), b""):
            digest.update(chunk)
    return digest.hexdigest()


def recorded_signature(meta: dict) -> dict:
    """The signature a ``meta.json`` records, no file read: a shard's records its ``tokenizer_sha256``, a plain
    folder's none (None)."""
    return {key: meta.get(key) for key in SIGNATURE_KEYS}


def tokenizer_signature(folder: str | Path, meta: dict | None = None) -> dict:
    """The signature of ``folder``'s tokenizer: ``meta`` (its ``meta.json``, read when None; a model folder has none)
    and the sha256 of its ``tokenizer.json`` (None without one). Sources of a mixture must share it; a resume must
    keep it."""
    folder = Path(folder)
    meta = meta if meta is not None else _meta_of(folder)
    tokenizer = folder / "tokenizer.json"
    return {**recorded_signature(meta), "tokenizer_sha256": file_sha256(tokenizer) if tokenizer.is_file() else None}


def tokenizer_name(folder: str | Path) -> str:
    """``folder`` and, for a prepared folder, the tokenizer ``meta.json`` says it was prepared with: for messages."""
    name = _meta_of(Path(folder)).get("tokenizer")
    return f"{folder} (tokenizer {name})" if name else str(folder)


def tokenizer_differences(a: dict, b: dict) -> list[tuple[str, object, object]]:
    """``(label, a's value, b's value)`` for each signature key that both record and that differs."""
    return [(_LABELS.get(k, k), a[k], b[k]) for k in SIGNATURE_KEYS
            if a.get(k) is not None and b.get(k) is not None and a[k] != b[k]]


def check_same_tokenizer(a: str | Path | dict, b: str | Path | dict, *, what: str, fix: str,
                         allow: bool = False) -> None:
    """UserError ``{what} (the differences): ... {fix}`` unless ``a`` and ``b`` hold one tokenizer; with ``allow`` a
    warning without the fix.

    ``a`` and ``b``: folders (their signature is computed) or signatures (:func:`recorded_signature`, a checkpoint's
    record). Two folders of which one is a model folder whose ``tokenizer.json`` differs only in bytes are compared
    by vocabulary (see the module docstring).
    """
    signatures = [x if isinstance(x, dict) else tokenizer_signature(x) for x in (a, b)]
    differ = tokenizer_differences(*signatures)
    if not differ:
        return
    shown = [f"{label} {_short(x)} vs {_short(y)}" for label, x, y in differ]
    if len(differ) == 1 and differ[0][0] == _LABELS["tokenizer_sha256"] and _has_model_folder(a, b):
        other = _ids_naming_other_tokens(Path(a), Path(b))
        if other == 0:
            logger.info("%s and %s hold tokenizer.json files that differ in bytes but define the same ids", a, b)
            return
        if other is not None:
            shown.append(f"{other} ids that both define name other tokens")
    if allow:
        logger.warning("%s (%s), allowed: the results mean something only if the two encode alike.", what,
                       "; ".join(shown))
        return
    raise fail(f"{what} ({'; '.join(shown)}): the same token id stands for other text in each. {fix}")


def _has_model_folder(a: str | Path | dict, b: str | Path | dict) -> bool:
    """Both are folders and one has no ``meta.json``: a model folder, whose tokenizer.json need not be the bytes
    that preparation writes."""
    folders = [x for x in (a, b) if not isinstance(x, dict)]
    return len(folders) == 2 and any(not (Path(x) / "meta.json").is_file() for x in folders)


def _short(value: object) -> object:
    return f"{value[:12]}..." if isinstance(value, str) and len(value) == 64 else value  # a sha256: its start will do


def _meta_of(folder: Path) -> dict:
    """``folder``'s ``meta.json`` as a dict; empty for a folder without one (a model folder)."""
    path = folder / "meta.json"
    if not path.is_file():
        return {}
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return meta if isinstance(meta, dict) else {}


def _ids_naming_other_tokens(a: Path, b: Path) -> int | None:
    """How many ids that both folders' ``tokenizer.json`` define name different tokens; None if one does not load."""
    from tokenizers import Tokenizer

    vocabs = []
    for folder in (a, b):
        try:
            vocab = Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab(with_added_tokens=True)
        except Exception:  # noqa: BLE001 - the tokenizers library raises plain Exception for a file it cannot read
            return None
        vocabs.append({i: token for token, i in vocab.items()})
    return sum(vocabs[0][i] != vocabs[1][i] for i in vocabs[0].keys() & vocabs[1].keys())
