"""The prepared-data folder format, read side: ``meta.json``, the memory-mapped tokens and their start-up checks.

The folder (version :data:`FORMAT_VERSION`) is written by ``lmrecipe/data/prepare/``: ``train.bin``/``val.bin``
(token ids), ``train.idx``/``val.idx`` (uint64 document offsets) and ``meta.json``. Start-up reads ``meta.json``
and checks it against the files' sizes (:func:`load_meta`, the one call for a folder; :func:`read_meta_file` is its
schema check of the file alone) and a fixed sample of their contents (:class:`TokenWindows`): constant
time, whatever the number of tokens. The largest token id comes from ``meta.json``, not from a scan of the tokens.
Under document masking the document index alone is read whole (:func:`check_index`: in order, inside the split),
in one fast pass.

A shard set (``tools/prepare_data.py --shard i/N``) is a folder whose ``meta.json`` lists ``shards``: sub-folders of
this format, prepared from disjoint parts of one corpus with one tokenizer. Its splits are the shards' splits laid
end to end in the listed order (``lmrecipe/data/stream.py``); ``meta.json``'s ``splits`` describe the whole, its
``shards`` each part (counts, ``max_token_id`` and ``sha256``, checked at start-up against each shard's own
``meta.json``, which also records its place in the set and its tokenizer). Everything that takes a data folder takes
a shard set.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from lmrecipe.data.documents import DocumentBatch, document_batch
from lmrecipe.data.stream import TokenStream
from lmrecipe.data.tokenizer import (  # noqa: F401 - file_sha256 and tokenizer_signature: callers import them from here
    check_same_tokenizer,
    file_sha256,
    recorded_signature,
    tokenizer_signature,
)
from lmrecipe.errors import fail

# torch is imported where tensors are built, not here: the tokenizer workers of data preparation import the format
# module for its constants, and torch would cost each of them about 200 MB of memory and a second or two.
if TYPE_CHECKING:
    import torch


FORMAT_VERSION = 2
"""Version of the prepared-data folder format (``meta.json`` ``format_version``) that this code reads and writes.

Version 2 added the document index (``<split>.idx``) and each split's ``max_token_id``."""
SPLITS = ("train", "val")
INDEX_DTYPE = np.dtype("<u8")
"""Element type of ``<split>.idx``: token offsets of document starts, then the split's token count."""
_META_KEYS = ("format_version", "tokenizer", "vocab_size", "eos_id", "dtype", "source", "splits")
_SPLIT_KEYS = ("n_tokens", "n_documents", "max_token_id")
_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
# The start-up sample: this many blocks of this many tokens, spread evenly over a split, are checked against
# meta.json's max_token_id, and this many document ends (spread evenly) must hold EOS. A few MB read, at most.
_SAMPLE_BLOCKS = 16
_SAMPLE_BLOCK_TOKENS = 4096
_SAMPLE_DOCUMENTS = 64
# In a shard set, this many shards (spread evenly, first and last included) get that sample at start-up.
_SAMPLE_SHARDS = 16
_INDEX_BLOCK = 1 << 22
"""Entries of a document index compared per block by :func:`check_index` (32 MB). A billion documents (an 8 GB index,
about a trillion tokens) took 0.5-1.0 s on this project's 2-core CPU with the file in the page cache; from disk, the
time to read the file."""
SHARD_NAME = re.compile(r"shard-(\d{5})-of-(\d{5})")
"""Name of the folder of shard i of N inside a shard set: ``shard-{i:05d}-of-{N:05d}``."""


def load_meta(data_dir: str | Path) -> dict:
    """The checked ``meta.json`` of a prepared data folder: call this before using a folder's tokens.

    Checks the folder (it exists and is not empty), the file (:func:`read_meta_file`) and the token files against
    it (each ``.bin`` and ``.idx`` has the size ``meta.json`` implies); UserError naming the fix otherwise.
    """
    data_dir = Path(data_dir)
    _refuse_leftover(data_dir)
    how_to_make = prepare_hint(data_dir)
    if data_dir.exists() and not data_dir.is_dir():
        raise fail(f"Data folder {str(data_dir)!r} is a file, not a prepared data folder. Pass the folder that "
                   f"tools/prepare_data.py wrote (it holds meta.json).")
    if not data_dir.is_dir():
        raise fail(f"Data folder {str(data_dir)!r} does not exist. {how_to_make}")
    if not any(data_dir.iterdir()):
        raise fail(f"Data folder {str(data_dir)!r} is empty. {how_to_make}")
    meta = read_meta_file(data_dir)
    if "shards" in meta:
        check_shards(data_dir, meta)
        return meta
    for name in SPLITS:
        _check_sizes(data_dir, name, meta, how_to_make)
    return meta


def prepare_hint(data_dir: str | Path, overwrite: bool = False) -> str:
    """How to prepare ``data_dir`` from the user's own corpus and tokenizer. Without ``--input``, prepare_data.py
    prepares its embedded demo corpus, which a bare ``--output`` hint would put under any recipe's data name."""
    return (f"Prepare it from your corpus: `python tools/prepare_data.py --input CORPUS --tokenizer TOKENIZER --output "
            f"{data_dir}{' --overwrite' if overwrite else ''}` (CORPUS: text, .jsonl or .parquet files or folders of "
            "them, or --hub-dataset NAME instead of --input; TOKENIZER: the model's tokenizer, a Hub name or a folder, "
            "or leave it out to train a BPE of --vocab-size tokens). Without --input it prepares the embedded demo "
            "corpus (Python's standard library), not your data.")


def shard_name(index: int, count: int) -> str:
    return f"shard-{index:05d}-of-{count:05d}"


def check_shards(data_dir: Path, meta: dict) -> None:
    """Each shard a shard set's ``meta.json`` lists exists, is a complete folder, and is the one it describes, at
    its place in the list (its own index and count), prepared with the set's tokenizer and arguments; the set's
    totals are its shards'; no shard folder it does not list sits beside them.

    Reads each shard's ``meta.json`` and file sizes and the set's ``tokenizer.json`` (not the tokens): a shard
    missing, re-prepared, swapped or added since the set's ``meta.json`` was written, or that file edited by hand,
    fails here, with the fix.
    """
    shards = meta["shards"]
    finish = (f"Run `python tools/prepare_data.py --output {data_dir} --finish-shards` to list the set's shards "
              f"again (it names any that are missing).")
    if not isinstance(shards, list) or not shards or any(not isinstance(e, dict) or "path" not in e or "splits" not in e
                                                           for e in shards):
        raise fail(f"{data_dir / 'meta.json'} has a malformed shards list. {finish}")
    names = [str(entry["path"]) for entry in shards]
    twice = sorted(n for n, times in collections.Counter(names).items() if times > 1)
    if twice or any(Path(n).name != n or n in ("", ".", "..") for n in names):
        what = f"{', '.join(twice)} more than once" if twice else "a shard path outside the folder"
        raise fail(f"{data_dir / 'meta.json'} lists {what}: a shard set names each shard once, as a sub-folder. {finish}")
    set_tokenizer = tokenizer_signature(data_dir, meta)
    check_same_tokenizer(recorded_signature(meta), set_tokenizer,
                         what=f"{data_dir / 'tokenizer.json'} is not the tokenizer {data_dir / 'meta.json'} records",
                         fix=f"It was replaced after the set was finished: run `python tools/prepare_data.py --output "
                             f"{data_dir} --finish-shards`, which copies it again from the shards.")
    first = None
    for position, entry in enumerate(shards):
        shard = _check_shard(data_dir, meta, entry, position, set_tokenizer, finish)
        first = first or (entry["path"], shard)
        differ = shard_differences(shard, first[1])
        if differ:
            raise fail(f"Shards {entry['path']} and {first[0]} of the shard set {data_dir} were not prepared alike "
                       f"(they differ in {', '.join(differ)}): one was prepared again, with other inputs or arguments, "
                       f"after the set was finished. Prepare it again with the others' arguments (--overwrite), then "
                       f"{_lower(finish)}")
    _check_totals(data_dir, meta, finish)
    _refuse_strays(data_dir, set(names), finish)


def _check_shard(data_dir: Path, meta: dict, entry: dict, position: int, set_tokenizer: dict, finish: str) -> dict:
    """The shard of ``entry`` (at ``position`` of the set's list) is complete and the one the list describes, at
    its place, with the set's tokenizer; its ``meta.json``."""
    folder = data_dir / entry["path"]
    if not (folder / "meta.json").is_file():
        raise fail(f"Shard {folder} of the shard set {data_dir} is missing (no such complete folder): it was moved "
                   f"or deleted after the set was finished. Restore it, or prepare it again with the same "
                   f"command and --shard {_shard_arg(entry['path'])}, then {_lower(finish)}")
    shard = read_meta_file(folder)
    changed = [f"{split} {key}" for split in SPLITS for key in (*_SPLIT_KEYS, "sha256")
               if shard["splits"][split].get(key) != entry["splits"].get(split, {}).get(key)]
    if changed:
        raise fail(f"Shard {folder} differs from what {data_dir / 'meta.json'} records of it ({', '.join(changed)}): "
                   f"it was prepared again after the set was finished. {finish}")
    _check_position(data_dir, folder, shard, position, len(meta["shards"]), finish)
    check_same_tokenizer(
        set_tokenizer, recorded_signature(shard),
        what=f"Shard {folder} was prepared with another tokenizer ({shard.get('tokenizer')}) than the shard set "
             f"{data_dir} records ({meta.get('tokenizer')})",
        fix=f"Prepare it again with the set's tokenizer (`python tools/prepare_data.py ... --tokenizer {data_dir} "
            f"--output {data_dir} --shard {_shard_arg(entry['path'])} --overwrite`), then {_lower(finish)}")
    for split in SPLITS:
        _check_sizes(folder, split, shard, f"Prepare it again with --shard {_shard_arg(entry['path'])}.")
    return shard


def _check_totals(data_dir: Path, meta: dict, finish: str) -> None:
    """The set's splits are its shards' laid end to end (:func:`combine_splits` of the list's entries)."""
    for split in SPLITS:
        whole = combine_splits([entry["splits"][split] for entry in meta["shards"]])
        edited = [f"{key} {meta['splits'][split].get(key)!r} where its shards add up to {whole[key]!r}"
                  for key in whole if meta["splits"][split].get(key) != whole[key]]
        if edited:
            raise fail(f"{data_dir / 'meta.json'} describes its {split} split with {'; '.join(edited)}: the file was "
                       f"edited by hand. {finish}")


def _refuse_strays(data_dir: Path, listed: set[str], finish: str) -> None:
    """UserError for a shard folder the set does not list (a shard of another count copied in, or an entry removed):
    a set never silently leaves out a shard that sits in it."""
    strays = sorted(p.name for p in data_dir.iterdir() if SHARD_NAME.fullmatch(p.name) and p.name not in listed
                    and p.is_dir())
    if strays:
        raise fail(f"{data_dir} holds shard folders its meta.json does not list ({', '.join(strays[:8])}"
                   f"{f' and {len(strays) - 8} more' if len(strays) > 8 else ''}): a shard of another preparation was "
                   f"added to the set, or the list was edited by hand. Move the folders that do not belong out of "
                   f"{data_dir}, then {_lower(finish)}")


def _lower(sentence: str) -> str:
    """``sentence`` to follow "then": its first letter in lower case."""
    return sentence[0].lower() + sentence[1:]


def _check_position(data_dir: Path, folder: Path, shard: dict, position: int, count: int, finish: str) -> None:
    """The shard at ``position`` of a set's list of ``count`` is shard ``position`` of ``count``, as its own
    ``meta.json`` records: the set's stream is the corpus's reading order only in that order."""
    plan = shard.get("shard", {}).get("plan") if isinstance(shard.get("shard"), dict) else None
    if not isinstance(plan, dict):
        raise fail(f"{folder} is a prepared folder but not a shard (its meta.json has no shard record), yet "
                   f"{data_dir / 'meta.json'} lists it. Move it out of the set and prepare the shard with --shard, "
                   f"then {_lower(finish)}")
    if (plan.get("index"), plan.get("count")) != (position, count):
        raise fail(f"{data_dir / 'meta.json'} lists {folder.name} as shard {position} of {count}, but it is shard "
                   f"{plan.get('index')} of {plan.get('count')} (its own meta.json): the list was reordered or "
                   f"shortened by hand, and the set would not read the corpus in its order. {finish}")


def shard_differences(shard: dict, first: dict) -> list[str]:
    """What two shards' ``meta.json`` say was prepared differently: the corpus's file listing, the arguments that
    shape the tokens (``shard.args``), the tokenizer. Empty for two shards of one preparation."""
    plan, first_plan = shard["shard"]["plan"], first["shard"]["plan"]
    args, first_args = shard["shard"].get("args", {}), first["shard"].get("args", {})
    differ = [key for key in ("listing_sha256", "n_files") if plan.get(key) != first_plan.get(key)]
    differ += [key for key in sorted(set(args) | set(first_args)) if args.get(key) != first_args.get(key)]
    return differ + [key for key in ("vocab_size", "eos_id", "dtype", "tokenizer_sha256")
                     if shard.get(key) != first.get(key)]


def combine_splits(parts: list[dict]) -> dict:
    """A shard set's split from its shards' (in order): counts summed, the largest id, and the sha256 of the shards'
    sha256s (sha256 does not compose, and the whole is not read again: a changed shard changes it, and the same
    corpus in another number of shards gives another value)."""
    tops = [p.get("max_token_id") for p in parts if p.get("max_token_id") is not None]
    return {
        "n_tokens": sum(int(p.get("n_tokens") or 0) for p in parts),
        "n_documents": sum(int(p.get("n_documents") or 0) for p in parts),
        "max_token_id": max(tops) if tops else None,
        "sha256": hashlib.sha256(",".join(str(p.get("sha256") or "") for p in parts).encode()).hexdigest(),
    }


def _shard_arg(name: str) -> str:
    match = SHARD_NAME.fullmatch(name)
    return f"{int(match.group(1))}/{int(match.group(2))}" if match else "i/N"


def read_meta_file(data_dir: str | os.PathLike) -> dict[str, Any]:
    """``meta.json`` of ``data_dir`` alone: parsed and checked against the schema, the token files not looked at.

    A part of :func:`load_meta`, which training and evaluation call; UserError if the file is missing, not JSON, of
    another format version or lacking a key.
    """
    data_dir = Path(data_dir)
    _refuse_leftover(data_dir)
    path = data_dir / "meta.json"
    remedy = prepare_hint(data_dir, overwrite=True)
    if not path.is_file():
        if data_dir.is_dir() and any(SHARD_NAME.fullmatch(p.name.split(".tmp-")[0]) for p in data_dir.iterdir()):
            raise fail(f"{data_dir} holds shards of a sharded preparation but no meta.json: the set is not finished "
                       f"(a shard is missing or still being written). Run `python tools/prepare_data.py --output "
                       f"{data_dir} --finish-shards`, which lists what is missing and writes meta.json once every "
                       f"shard is there.")
        raise fail(f"{path} not found: {data_dir} is not a prepared data folder. {remedy}")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise fail(f"{path} is not readable JSON ({err}). {remedy}") from err
    if not isinstance(meta, dict):
        raise fail(f"{path} must hold a JSON object, found {type(meta).__name__}. {remedy}")
    missing = [key for key in _META_KEYS if key not in meta]
    if missing:
        raise fail(f"{path} lacks {', '.join(missing)}. {remedy}")
    _check_version(meta["format_version"], path, remedy)
    if meta["dtype"] not in ("uint16", "uint32"):
        raise fail(f"{path} has dtype {meta['dtype']!r}; expected uint16 or uint32. {remedy}")
    splits = meta["splits"]
    if not isinstance(splits, dict) or any(not isinstance(splits.get(s), dict) or any(k not in splits[s] for k in _SPLIT_KEYS)
                                           for s in SPLITS):
        raise fail(f"{path} must describe splits train and val, each with {', '.join(_SPLIT_KEYS)}. {remedy}")
    return meta


def _refuse_leftover(data_dir: Path) -> None:
    """UserError for the ``<output>.tmp-<pid>`` folder of an interrupted preparation, naming its real destination."""
    match = re.fullmatch(r"(.+)\.tmp-\d+", data_dir.name)
    if match is None or (data_dir / "meta.json").is_file():
        return
    dest = data_dir.with_name(match.group(1))
    use = f"Delete it, and use {dest}, which exists." if dest.is_dir() else f"Delete it. {prepare_hint(dest)}"
    raise fail(f"{data_dir} is the temporary folder of an interrupted preparation into {dest}, not a prepared data "
               f"folder. {use}")


def _check_version(version: Any, path: Path, remedy: str) -> None:
    if version == FORMAT_VERSION:
        return
    if isinstance(version, int) and version < FORMAT_VERSION:
        data_dir = path.parent
        raise fail(
            f"{data_dir} was prepared in data format version {version}, which has no document "
            f"index and no max_token_id; this code reads version {FORMAT_VERSION}. Re-prepare it with the same "
            f"inputs: `python tools/prepare_data.py --output {data_dir} --overwrite` (plus the --input, "
            f"--tokenizer or --vocab-size it was made with)."
        )
    raise fail(f"{path} has format_version {version!r}; this code reads {FORMAT_VERSION}. {remedy}")


def _check_sizes(data_dir: Path, split: str, meta: dict, how_to_make: str) -> None:
    """The split's ``.bin`` and ``.idx`` hold the bytes that ``meta.json``'s token and document counts imply."""
    path = data_dir / f"{split}.bin"
    n_tokens = int(meta["splits"][split]["n_tokens"])
    if not path.is_file():
        raise fail(f"{path} is missing although meta.json lists it. Re-create the folder. {how_to_make}")
    expected = n_tokens * np.dtype(_DTYPES[meta["dtype"]]).itemsize
    actual = path.stat().st_size
    if actual != expected:
        raise fail(
            f"{path} holds {actual} bytes but meta.json says {n_tokens} {meta['dtype']} tokens "
            f"({expected} bytes): the file is truncated or from another preparation. Re-create the folder. {how_to_make}"
        )
    index_path = data_dir / f"{split}.idx"
    n_documents = int(meta["splits"][split]["n_documents"])
    expected = (n_documents + 1) * INDEX_DTYPE.itemsize
    actual = index_path.stat().st_size if index_path.is_file() else None
    if actual != expected:
        found = "is missing" if actual is None else f"holds {actual} bytes"
        raise fail(
            f"{index_path} {found} but meta.json says {n_documents} documents ({expected} bytes): the folder is "
            f"incomplete or mixed from two preparations. Re-create the folder. {how_to_make}"
        )


class TokenWindows:
    """Windows of ``seq_len + 1`` tokens over one split's memmap, or a shard set's split (its shards' memmaps laid
    end to end, :attr:`stream`); window i starts at token i*seq_len.

    Opening checks a fixed sample of the split against ``meta.json`` (see :func:`check_sample`), in constant time,
    and the document index's ends (:func:`check_index`; its order with :meth:`check_documents`): a file swapped or
    damaged since preparation fails here rather than mid-run.
    """

    def __init__(self, data_dir: str | Path, split: str, seq_len: int, meta: dict | None = None):
        meta = meta if meta is not None else load_meta(data_dir)
        self.path = Path(data_dir) / f"{split}.bin"
        self.seq_len = seq_len
        if int(meta["splits"][split]["n_tokens"]) == 0:
            raise fail(
                f"The {split} split of {data_dir} is empty (0 tokens in {self.path}). Re-prepare it with more "
                f"documents, or with a --val-fraction that leaves documents in both splits: "
                f"`python tools/prepare_data.py --output {data_dir} --overwrite ...`."
            )
        self.max_token_id = int(meta["splits"][split]["max_token_id"])
        """The largest id ``meta.json`` records (checked against the model's vocabulary at start); every window is
        checked against it as it is read."""
        self.index_path = Path(data_dir) / f"{split}.idx"
        self.stream: TokenStream | None = None
        """A shard set's split, its shards laid end to end (None for one folder)."""
        if "shards" in meta:
            self.tokens = self._open_shards(Path(data_dir), split, meta)
        else:
            # mode="r" maps the file read-only: pages are read on demand, never copied whole into memory.
            self.tokens = np.memmap(self.path, dtype=_DTYPES[meta["dtype"]], mode="r")
            self.index_files = [(self.index_path, len(self.tokens))]
            check_index(self.index_path, len(self.tokens), whole=False)
            check_sample(self.tokens, self.index_path, meta, split)
        self.n_windows = (len(self.tokens) - 1) // seq_len
        if self.n_windows < 1:
            raise fail(
                f"data.seq_len={seq_len} is longer than the {split} split ({len(self.tokens)} tokens in {self.path}); "
                f"a window needs seq_len + 1 tokens. Lower data.seq_len or prepare more data."
            )
        if self.stream is not None:
            return
        # Every window as a row of one strided view of the map (rows overlap by a token; still memory-mapped, no
        # copy): a batch is one index along the rows, each row copied whole. Slicing the np.memmap once per window
        # and stacking was several times slower (BENCHMARKS.md section 3).
        view = self.tokens.view(np.ndarray)
        self._rows = np.lib.stride_tricks.as_strided(view, shape=(self.n_windows, seq_len + 1),
                                                     strides=(seq_len * view.itemsize, view.itemsize), writeable=False)

    def _open_shards(self, data_dir: Path, split: str, meta: dict) -> TokenStream:
        """The shards' splits as one stream; every shard's index's ends are checked, and a sample of up to
        ``_SAMPLE_SHARDS`` shards' tokens (constant time)."""
        folders = [data_dir / entry["path"] for entry in meta["shards"]]
        lengths = [int(entry["splits"][split]["n_tokens"]) for entry in meta["shards"]]
        self.index_files = [(folder / f"{split}.idx", n_tokens) for folder, n_tokens in zip(folders, lengths)]
        for index_path, n_tokens in self.index_files:
            check_index(index_path, n_tokens, whole=False)
        self.stream = TokenStream([f / f"{split}.bin" for f in folders], lengths, _DTYPES[meta["dtype"]], self.seq_len)
        kept = self.stream.kept
        for k in np.unique(np.linspace(0, len(kept) - 1, num=min(_SAMPLE_SHARDS, len(kept))).round().astype(int)):
            entry = meta["shards"][kept[k]]
            check_sample(self.stream.piece(int(k)), folders[kept[k]] / f"{split}.idx",
                         {"eos_id": meta["eos_id"], "splits": entry["splits"]}, split)
        return self.stream

    def __len__(self) -> int:
        return self.n_windows

    def window(self, i: int) -> np.ndarray:
        """The ``seq_len + 1`` tokens of window ``i``, int64, checked as :meth:`rows` checks them."""
        return self.rows(np.asarray([i]))[0]

    def rows(self, window_ids) -> np.ndarray:
        """The ``seq_len + 1`` tokens of each window, ``[len(window_ids), seq_len + 1]`` int64, checked against
        ``max_token_id``.

        The start-up sample cannot see every token; this check does, as each window is read, on the host (in
        training, on the prefetch thread), so an id past the vocabulary stops the run with a message instead of an
        index error in the embedding (on a GPU, a device-side assert that kills the process).
        """
        L = self.seq_len
        ids = np.asarray(window_ids, dtype=np.int64).reshape(-1)
        rows = self._rows[ids].astype(np.int64) if self.stream is None else self.stream.rows(ids)
        if rows.size and int(rows.max()) > self.max_token_id:
            row, col = np.argwhere(rows > self.max_token_id)[0]
            i, at = int(ids[row]), int(ids[row]) * L + int(col)
            where = self.path if self.stream is None else f"the {self.path.stem} split of the shard set {self.path.parent}"
            raise fail(f"{where} holds token id {int(rows[row, col])} at token {at} (window {i}), above the "
                       f"largest id meta.json records ({self.max_token_id}), which the model's vocabulary was checked "
                       f"against: the file was changed or damaged after preparation. Re-create the folder with the same "
                       f"inputs: python tools/prepare_data.py --output {self.path.parent} --overwrite ...")
        return rows

    def batch(self, window_ids: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets, both ``[len(window_ids), seq_len]`` int64."""
        return split_rows(self.rows(window_ids))

    @functools.cached_property
    def doc_starts(self) -> np.ndarray:
        """The split's document index (``<split>.idx``): document starts, then the token count; memory-mapped.
        One folder only: a shard set keeps one index per shard (:meth:`documents_at` reads them)."""
        if self.stream is not None:
            raise TypeError("a shard set has one document index per shard: use documents_at")
        return np.memmap(self.index_path, dtype=INDEX_DTYPE, mode="r")

    def check_documents(self) -> None:
        """Every document index of this split in order (:func:`check_index`, one pass over each): what document
        masking reads its boundaries from. Without masking start-up never reads the indexes whole."""
        for index_path, n_tokens in self.index_files:
            check_index(index_path, n_tokens)

    def documents(self, window_ids: np.ndarray) -> DocumentBatch:
        """Where the documents start inside the given windows' inputs (numpy arrays, see ``data/documents.py``)."""
        return self.documents_at(np.asarray(window_ids, dtype=np.int64) * self.seq_len, self.seq_len)

    def documents_at(self, offsets: np.ndarray, n_tokens: int) -> DocumentBatch:
        """Where the documents start inside the spans of ``n_tokens`` tokens at the given token offsets of the split."""
        if self.stream is not None:
            return self.stream.documents(offsets, n_tokens)
        return document_batch(self.doc_starts, np.asarray(offsets, dtype=np.int64), n_tokens)


def split_rows(rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets of int64 rows of ``seq_len + 1`` tokens, both ``[n, seq_len]``."""
    import torch

    return torch.from_numpy(rows[:, :-1]), torch.from_numpy(rows[:, 1:])


def sample_blocks(n_tokens: int) -> list[tuple[int, int]]:
    """The (start, stop) token ranges that :func:`check_sample` reads: fixed, evenly spread, first and last included."""
    block = min(_SAMPLE_BLOCK_TOKENS, n_tokens)
    starts = np.unique(np.linspace(0, n_tokens - block, num=_SAMPLE_BLOCKS).round().astype(np.int64))
    return [(int(start), int(start) + block) for start in starts]


def check_index(index_path: Path, n_tokens: int, whole: bool = True) -> None:
    """UserError unless the document index ``index_path`` starts at 0, never decreases, and ends at the split's
    ``n_tokens``: every offset then lies inside the split, and the boundaries :mod:`~lmrecipe.data.documents`
    finds by binary search are the documents'. Sizes were checked before (``meta.json``); with ``whole`` this reads
    the whole memory-mapped index once, in blocks of ``_INDEX_BLOCK`` entries (bounded memory; see the constant for
    its cost), else only its first and last entries.
    """
    offsets = np.memmap(index_path, dtype=INDEX_DTYPE, mode="r")
    fix = (f"The index does not belong to {index_path.with_suffix('.bin')}, or was damaged: re-create the folder with "
           f"the same inputs (python tools/prepare_data.py --output {index_path.parent} --overwrite ...).")
    first, last = int(offsets[0]), int(offsets[-1])
    if first != 0 or last != n_tokens:
        raise fail(f"{index_path} runs from token {first} to token {last}, but its split holds tokens 0 to {n_tokens} "
                   f"(an index lists each document's first token, the first 0, then the split's token count). {fix}")
    if not whole:
        return
    for start in range(0, len(offsets) - 1, _INDEX_BLOCK):
        block = offsets[start:start + _INDEX_BLOCK + 1]
        down = np.flatnonzero(block[1:] < block[:-1])
        if down.size:
            at = start + int(down[0]) + 1
            raise fail(f"{index_path} is not in ascending order: entry {at} (token {int(offsets[at])}) comes after "
                       f"entry {at - 1} (token {int(offsets[at - 1])}), so documents would start in the wrong places "
                       f"under data.document_masking. {fix}")


def check_sample(tokens: np.ndarray, index_path: Path, meta: dict, split: str) -> None:
    """Check a fixed sample of one split against ``meta.json``; UserError naming the fix if it disagrees.

    Reads :func:`sample_blocks` (ids must not exceed ``max_token_id``) and the tokens before up to
    ``_SAMPLE_DOCUMENTS`` evenly spread document ends (each must be EOS); the index's first and last entries were
    checked before (:func:`check_index`). Constant time:
    a token past ``max_token_id`` outside the sample is not seen, by design (start-up never reads every token).
    """
    info = meta["splits"][split]
    fix = "Re-create the folder with tools/prepare_data.py (--overwrite)."
    top = int(info["max_token_id"])
    for start, stop in sample_blocks(len(tokens)):
        found = int(tokens[start:stop].max())
        if found > top:
            raise fail(f"{index_path.with_suffix('.bin')} holds token id {found} (tokens {start}-{stop}) but meta.json "
                       f"says the largest id is {top}: the file does not belong to this meta.json. {fix}")
    offsets = np.memmap(index_path, dtype=INDEX_DTYPE, mode="r")
    n_documents = len(offsets) - 1
    picks = np.unique(np.linspace(1, n_documents, num=min(_SAMPLE_DOCUMENTS, n_documents)).round().astype(np.int64))
    ends = offsets[picks].astype(np.int64)
    if (ends < 1).any() or (ends > len(tokens)).any() or (tokens[ends - 1] != int(meta["eos_id"])).any():
        raise fail(f"{index_path} does not match {index_path.with_suffix('.bin')}: document ends do not fall on EOS "
                   f"tokens. {fix}")


VOCAB_PADDING = 128
"""A model vocabulary above the data's, up to the next multiple of this, is padding (a shape the matmul kernels
prefer), not another tokenizer."""


def check_model_vocab(model_vocab_size: int | None, meta: dict, data_dir: str | Path) -> None:
    """UserError when ``model.vocab_size`` exceeds the vocabulary of the tokenizer ``data_dir`` was prepared with by
    more than padding (:data:`VOCAB_PADDING`): the model was sized for another tokenizer. (Below the data's,
    :func:`open_data` refuses it.)"""
    data_vocab = int(meta["vocab_size"])
    if model_vocab_size is None or model_vocab_size <= -(-data_vocab // VOCAB_PADDING) * VOCAB_PADDING:
        return
    raise fail(f"model.vocab_size={model_vocab_size:,} but {data_dir} was prepared with a tokenizer of "
               f"{data_vocab:,} tokens ({meta.get('tokenizer', 'its meta.json')}): the model is sized for another "
               f"tokenizer, and {model_vocab_size - data_vocab:,} of its embedding rows would never see a token. Set "
               "model.vocab_size=null to take the data's, or prepare the data with the model's tokenizer: `python "
               "tools/prepare_data.py --input CORPUS --tokenizer TOKENIZER --output NEW_DATA`, then data.path=NEW_DATA "
               "(or set model.vocab_beyond_data=true to keep that shape on purpose, e.g. to measure its speed).")


def open_data(data_dir: str | Path, seq_len: int, model_vocab_size: int | None,
              documents: bool = True) -> tuple[dict, TokenWindows, TokenWindows]:
    """Open both splits with the start-up checks: meta vs files, seq_len vs split sizes, ids vs vocab, and with
    ``documents`` (document masking reads them) the document indexes' order.

    The ids are checked against ``meta.json``'s ``max_token_id`` per split and a fixed sample of the files, never
    by reading every token, so start-up takes the same time for a million tokens or fifty billion; the indexes'
    order costs one pass over each (see ``_INDEX_BLOCK``).
    """
    meta = load_meta(data_dir)
    train = TokenWindows(data_dir, "train", seq_len, meta)
    val = TokenWindows(data_dir, "val", seq_len, meta)
    if documents:
        train.check_documents()
        val.check_documents()
    if model_vocab_size is not None:
        if int(meta["vocab_size"]) > model_vocab_size:
            raise fail(
                f"The data's tokenizer has vocab_size={meta['vocab_size']} but the model's vocab size is "
                f"{model_vocab_size}: token ids would index past the embedding. Set model.vocab_size >= "
                f"{meta['vocab_size']} (or null to take it from the data)."
            )
        for split, windows in zip(SPLITS, (train, val)):
            top = int(meta["splits"][split]["max_token_id"])
            if top >= model_vocab_size:
                raise fail(
                    f"{windows.path} contains token id {top} (meta.json max_token_id), which is >= the model's vocab "
                    f"size {model_vocab_size}. Set model.vocab_size above {top} or re-prepare the data with the "
                    f"model's tokenizer."
                )
    return meta, train, val
