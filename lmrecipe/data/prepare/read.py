"""Reading a corpus for preparation: documents from files, jsonl/json/parquet records, a Hub dataset or the embedded
corpus, streamed in a fixed order, and the hash rule that puts each document in train or val.

Documents are read one file or one record batch at a time (records through ``datasets`` with ``streaming=True``):
nothing is held beyond the current file or batch, and a plain-text file is read whole.

The train/val split is per document: a document goes to val when the first 8 bytes of sha256 of
``"<seed>:<key>"``, read as a fraction of 2**64, are below ``val_fraction``. So a document's split depends only
on its key and the seed: not on the order in which documents are read, on the other documents, or on how many
processes tokenize them.

Shards. ``shard=(i, N)`` reads a contiguous run of the corpus's files (:func:`assign_files`: files in reading order,
cut into N runs of about equal bytes): the N shards read disjoint files, and their documents laid end to end in
shard order are the documents of the whole corpus in reading order. Listing the files (names and sizes) is the only
work every shard repeats.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import sys
import sysconfig
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmrecipe.data.format import SPLITS
from lmrecipe.errors import UserError, fail

logger = logging.getLogger(__name__)

#: Suffixes read as one plain-text document per file.
TEXT_SUFFIXES = frozenset(
    {".txt", ".text", ".md", ".rst", ".tex", ".html", ".htm", ".xml", ".csv", ".tsv", ".py", ".pyi",
     ".c", ".h", ".cc", ".cpp", ".hpp", ".rs", ".go", ".java", ".js", ".ts", ".sh", ".toml", ".yaml",
     ".yml", ".ini", ".cfg"}
)
#: Suffixes read as records through the `datasets` loader named by the value.
RECORD_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}

_EMBEDDED_SUFFIXES = frozenset({".py", ".txt"})
_EMBEDDED_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib"})

# Records read from a jsonl/json/parquet file or a Hub dataset per batch.
_RECORD_BATCH = 1024
# Files that are not text, named in the log before it switches to a count.
_NAMED_SKIPS = 5


@dataclass(frozen=True)
class Document:
    """One document: ``key`` names it (relative path, or ``path:record``) and decides its split."""

    key: str
    text: str
    input_index: int
    """Which input (``--input`` argument, Hub dataset or embedded corpus) it came from."""


@dataclass
class ReadStats:
    """What one pass over a :class:`DocumentSource` read and skipped."""

    n_documents: int = 0
    n_chars: int = 0
    empty_documents: int = 0
    not_text_files: int = 0


class DocumentSource:
    """The documents named by ``inputs`` (files or folders), or ``hub_dataset``, or the embedded default.

    Plain-text files are one document each; ``.jsonl``/``.json``/``.parquet`` files hold one document per
    record, in ``text_field``. Folders are walked recursively in sorted order of relative path, skipping hidden
    entries and files of other types. Empty and whitespace-only documents are skipped, and so are plain-text
    files that are not UTF-8 text (invalid UTF-8, or NUL bytes): both are counted. At most ``max_documents``
    documents are read. :meth:`documents` reads from the start each time it is called, in the same order;
    nothing is held beyond the current file or record batch. Arguments are checked here, cheaply; folder
    contents and records are checked as they are read.
    """

    def __init__(
        self,
        inputs: Sequence[str | os.PathLike] = (),
        hub_dataset: str | None = None,
        text_field: str = "text",
        max_documents: int | None = None,
        shard: tuple[int, int] | None = None,
    ):
        if shard is not None and hub_dataset:
            raise fail(f"--shard reads a disjoint part of a corpus's files; a Hub dataset ({hub_dataset}) is streamed as "
                       "one. Download it to jsonl or parquet files first (e.g. `datasets`' to_json), then pass them "
                       "with --input.")
        if inputs and hub_dataset:
            raise fail("Pass either --input or --hub-dataset, not both.")
        if max_documents is not None and max_documents < 1:
            raise fail(f"--max-documents must be at least 1, got {max_documents}.")
        self.inputs = [Path(raw) for raw in inputs]
        self.hub_dataset = hub_dataset
        self.text_field = text_field
        self.max_documents = max_documents
        self.shard = shard
        self._shard_plan: tuple[dict, list[tuple[int, str, Path]]] | None = None
        if hub_dataset:
            self.names = [f"hub:{hub_dataset}"]
        elif inputs:
            _check_inputs(self.inputs)
            self.names = [str(raw) for raw in inputs]
        else:
            self.names = [f"python-stdlib-{sys.version_info.major}.{sys.version_info.minor}"]

    def describe(self, stats: ReadStats | None = None) -> str:
        """The ``source`` of ``meta.json``: the inputs, and the document limit if ``stats`` show it was reached."""
        text = ", ".join(self.names)
        if stats is not None and self.max_documents is not None and stats.n_documents >= self.max_documents:
            text += f" (first {self.max_documents} documents)"
        return text

    def documents(self, stats: ReadStats | None = None) -> Iterator[Document]:
        """Yield the documents in reading order, counting what was read and skipped into ``stats``."""
        stats = stats if stats is not None else ReadStats()
        limit = self.max_documents if self.max_documents is not None else sys.maxsize
        for doc in self._all_documents(stats):
            if stats.n_documents >= limit:
                return
            stats.n_documents += 1
            stats.n_chars += len(doc.text)
            yield doc

    def _all_documents(self, stats: ReadStats) -> Iterator[Document]:
        if self.hub_dataset:
            yield from _record_documents(_load_hub_dataset(self.hub_dataset), self.text_field, self.hub_dataset,
                                         self.hub_dataset, 0, stats)
            return
        files = self._files() if self.shard is None else self.shard_plan()[1]
        for index, key, path in files:
            yield from _file_documents(path, key, index, self.text_field, stats)

    def _files(self) -> Iterator[tuple[int, str, Path]]:
        """(input index, key, path) of every file, in reading order; the names are listed, no file is read."""
        if self.inputs:
            for index, path in enumerate(self.inputs):
                if path.is_dir():
                    unsupported = [0]
                    for rel, file in _walk_supported(path, path, unsupported):
                        yield index, rel, file
                    if unsupported[0]:
                        logger.info("%s: skipped %d files of unsupported types", path, unsupported[0])
                else:
                    yield index, path.name, path
        else:
            root = stdlib_root()
            for path in embedded_corpus_files():
                yield 0, path.relative_to(root).as_posix(), path

    def shard_plan(self) -> tuple[dict, list[tuple[int, str, Path]]]:
        """This shard's files and what ``meta.json`` records of them (``shard``: index, count, its run of files, and
        the sha256 of the whole listing, which every shard of one corpus shares)."""
        if self._shard_plan is None:
            index, count = self.shard
            files = list(self._files())
            sizes = [path.stat().st_size for _, _, path in files]
            listing = hashlib.sha256()
            for (input_index, key, _), size in zip(files, sizes):
                listing.update(f"{input_index}\0{key}\0{size}\n".encode())
            first, stop = assign_files(sizes, index, count)
            plan = {"index": index, "count": count, "files": [first, stop], "n_files": len(files),
                    "bytes": sum(sizes[first:stop]), "listing_sha256": listing.hexdigest()}
            self._shard_plan = plan, files[first:stop]
            logger.info("shard %d of %d: files %d-%d of %d (%.1f MB of %.1f MB)", index, count, first, stop, len(files),
                        plan["bytes"] / 1e6, sum(sizes) / 1e6)
        return self._shard_plan


def assign_files(sizes: Sequence[int], index: int, count: int) -> tuple[int, int]:
    """The run ``[first, stop)`` of files that shard ``index`` of ``count`` reads: file ``j`` goes to the shard its
    middle byte falls in when the corpus's bytes are cut into ``count`` equal parts (by file count if all are
    empty). Runs are contiguous, disjoint and cover every file; a shard may get none (a file larger than a part)."""
    total = sum(sizes)
    owners, before = [], 0
    for j, size in enumerate(sizes):
        if total:
            owners.append(min(count - 1, (2 * before + size) * count // (2 * total)))
        else:
            owners.append(j * count // len(sizes))
        before += size
    first = sum(1 for owner in owners if owner < index)
    return first, first + sum(1 for owner in owners if owner == index)


def embedded_corpus_files() -> list[Path]:
    """The default corpus: ``*.py`` and ``*.txt`` of the running Python's standard library.

    Third-party packages (``site-packages``, ``dist-packages``) and the test suites (``test``, ``tests``,
    ``idlelib``) are left out. Sorted by path relative to the standard library folder.
    """
    root = stdlib_root()
    files = []
    # os.walk with pruning, not rglob: site-packages can hold gigabytes that would be walked only to be dropped.
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [name for name in dirnames if name not in _EMBEDDED_EXCLUDED_DIRS]
        files.extend(
            Path(dirpath, name) for name in filenames
            if Path(name).suffix in _EMBEDDED_SUFFIXES and os.path.isfile(os.path.join(dirpath, name))
        )
    return sorted(files, key=lambda path: path.relative_to(root).as_posix())


def stdlib_root() -> Path:
    """The running Python's standard library folder: the embedded corpus, its documents keyed relative to it."""
    return Path(sysconfig.get_paths()["stdlib"])


def split_of(key: str, val_fraction: float, seed: int = 0) -> str:
    """``"val"`` when sha256 of ``"<seed>:<key>"`` (first 8 bytes, as a fraction of 2**64) is below ``val_fraction``.

    A document's split depends only on its key and the seed, so it stays in its split when other documents are
    added, removed or reordered; about ``val_fraction`` of the documents go to val.
    """
    digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    return "val" if int.from_bytes(digest[:8], "big") < val_fraction * 2**64 else "train"


def check_val_fraction(val_fraction: float) -> None:
    if not 0 < val_fraction <= 0.5:
        raise fail(f"--val-fraction must be in (0, 0.5], got {val_fraction}; 0.02 holds out 2% of documents.")


def train_sample(source: DocumentSource, val_fraction: float, seed: int, sample: dict) -> Iterator[str]:
    """Train documents from the start of ``source`` until ``sample["max_mb"]`` MB; counts go into ``sample``.

    The texts a trained BPE learns from. The first document is read before the generator is returned, so an
    input without documents fails here, with the message the tokenizing pass would give, rather than after
    training a BPE on nothing.
    """
    stats = ReadStats()
    train_texts = (doc.text for doc in source.documents(stats) if split_of(doc.key, val_fraction, seed) == "train")
    first = next(train_texts, None)
    if first is None:
        described = source.describe(stats)
        if stats.n_documents == 0:
            raise no_documents(described)
        raise _empty_split("train", stats.n_documents, described, val_fraction)
    return _take_mb(itertools.chain([first], train_texts), sample)


def _take_mb(texts: Iterator[str], sample: dict) -> Iterator[str]:
    """Texts until their UTF-8 size reaches ``sample["max_mb"]`` MB (whole texts), counted into ``sample``."""
    max_bytes = sample["max_mb"] * 1e6
    for text in texts:
        sample["n_documents"] += 1
        sample["n_bytes"] += len(text.encode("utf-8"))
        yield text
        if sample["n_bytes"] >= max_bytes:
            return


def check_splits(splits: dict[str, dict[str, Any]], stats: ReadStats, source: str, val_fraction: float) -> None:
    """UserError unless documents were read and each split received one (``splits``: per split, its counts)."""
    if stats.n_documents == 0:
        raise no_documents(source)
    for split in SPLITS:
        if splits[split]["n_documents"] == 0:
            raise _empty_split(split, stats.n_documents, source, val_fraction)


def no_documents(source: str) -> UserError:
    return fail(
        f"""
        No documents found in {source}: every file or record was empty or not text. Check --input (and
        --text-field for jsonl/parquet), or leave both out to use the embedded default corpus.
        """
    )


def _empty_split(split: str, n_documents: int, source: str, val_fraction: float) -> UserError:
    return fail(
        f"""
        The {split} split would be empty: {source} has {n_documents} document(s), and each goes to val with
        probability --val-fraction {val_fraction} (by a hash of its name). Each split needs a document, so
        at least 2 in all: add documents (each plain-text file is one document; split a large file into
        several, or use jsonl with one record per document), or change --val-fraction or --seed.
        """
    )


def _read_text(path: Path) -> str | None:
    """The file's text, or None if it is not UTF-8 text (invalid UTF-8, or NUL bytes, which text never holds)."""
    # Bytes then decode, not read_text: text mode would turn \r\n into \n, and the data should be the file.
    data = path.read_bytes()
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _supported_types() -> str:
    return ", ".join(sorted(TEXT_SUFFIXES | RECORD_SUFFIXES.keys()))


def _check_inputs(inputs: Sequence[Path]) -> None:
    """Fail on a missing input or a file of an unknown type; folders are checked as they are walked."""
    for path in inputs:
        if not path.exists():
            raise fail(
                f"--input {path} does not exist. Check the path, or leave out --input to use the embedded corpus."
            )
    for path in inputs:
        if not path.is_dir() and not _is_supported(path):
            raise fail(
                f"""
                --input {path}: unknown file type {path.suffix or '(no suffix)'!r}. Supported: {_supported_types()}
                (plain-text types are one document per file; jsonl/json/parquet one per record).
                """
            )


def _walk_supported(root: Path, folder: Path, unsupported: list[int]) -> Iterator[tuple[str, Path]]:
    """(relative posix path, path) of the supported files under ``folder``, sorted by relative path.

    Walks one folder at a time, so memory does not grow with the number of files. Sorting each folder's
    entries by name, with ``/`` appended to folder names, visits files in exactly the order of sorting all
    relative paths as strings. Hidden entries are skipped; links to folders are not followed.
    """
    with os.scandir(folder) as scan:
        entries = [(entry.name + "/" if entry.is_dir(follow_symlinks=False) else entry.name, entry)
                   for entry in scan if not entry.name.startswith(".")]
    for name, entry in sorted(entries, key=lambda item: item[0]):
        path = Path(entry.path)
        if name.endswith("/"):
            yield from _walk_supported(root, path, unsupported)
        elif not path.is_file():
            continue
        elif _is_supported(path):
            yield path.relative_to(root).as_posix(), path
        else:
            unsupported[0] += 1


def _is_supported(path: Path) -> bool:
    suffix = path.suffix.lower()
    return suffix in TEXT_SUFFIXES or suffix in RECORD_SUFFIXES


def _file_documents(path: Path, key: str, input_index: int, text_field: str, stats: ReadStats) -> Iterator[Document]:
    kind = RECORD_SUFFIXES.get(path.suffix.lower())
    if kind is not None:
        yield from _record_documents(_open_records(kind, path), text_field, key, str(path), input_index, stats)
        return
    text = _read_text(path)
    if text is None:
        stats.not_text_files += 1
        if stats.not_text_files <= _NAMED_SKIPS:
            logger.warning("skipped %s: not UTF-8 text%s", path,
                           "" if stats.not_text_files < _NAMED_SKIPS else " (further such files are only counted)")
    elif _is_empty(text):
        stats.empty_documents += 1
    else:
        yield Document(key, text, input_index)


def _is_empty(text: str | None) -> bool:
    # Whitespace-only documents are skipped too: they would train the model on bare EOS tokens.
    return not text or text.isspace()


def _open_records(kind: str, path: Path):
    import datasets

    # datasets logs a parse error itself (twice, through its handler and ours) before raising it: the UserError
    # below says it once, with the fix.
    logging.getLogger(f"datasets.packaged_modules.{kind}.{kind}").setLevel(logging.CRITICAL)
    try:
        return datasets.load_dataset(kind, data_files=str(path), split="train", streaming=True)
    except Exception as err:  # datasets wraps parse errors in several types; all mean "bad file"
        raise fail(f"Could not read {path} as {kind} records: {_describe(err)}. {_record_fix(path)}") from None


def _record_fix(where: str | Path) -> str:
    """How to mend a record file that does not parse."""
    if str(where).endswith(".jsonl"):
        return ("Each line of a .jsonl file must be one complete JSON object: fix or remove the broken line (rows "
                "are counted from 0), or leave the file out of --input.")
    return "Fix the file (it does not parse), or leave it out of --input."


def _describe(err: BaseException) -> str:
    """The message of ``err`` and of the errors that caused it: wrappers often hide the useful part."""
    messages: list[str] = []
    for _ in range(8):
        if err is None or len(messages) == 4:
            break
        message = str(err) or type(err).__name__
        if not any(message in seen for seen in messages):  # wrappers often repeat their cause's text
            messages.append(message)
        err = err.__cause__ or err.__context__
    return " <- ".join(messages)


def _load_hub_dataset(name: str):
    import datasets

    try:
        return datasets.load_dataset(name, split="train", streaming=True)
    except Exception as err:  # network, missing dataset, missing split: all mean "use local files instead"
        raise fail(
            f"Could not load Hub dataset {name!r}: {err}\nThis machine may be offline: pass local files with "
            "--input instead (jsonl, parquet or text)."
        ) from err


def _record_documents(
    dataset, text_field: str, key: str, where: str, input_index: int, stats: ReadStats
) -> Iterator[Document]:
    """The ``text_field`` of each record of a streaming ``dataset`` as documents ``<key>:<record index>``."""
    columns = dataset.column_names
    if columns is not None and text_field not in columns:
        raise fail(
            f"""
            {where} has no field {text_field!r}; its fields are {', '.join(columns)}. Pass
            --text-field with the name of the field that holds the document text.
            """
        )
    if columns is not None:
        dataset = dataset.select_columns([text_field])
    index = 0
    batches = iter(dataset.iter(batch_size=_RECORD_BATCH))
    while True:
        try:
            batch = next(batches, None)
        except Exception as err:  # a parse error deep in the file surfaces here, in one of several types
            raise fail(f"Could not read {where} (record {index} on): {_describe(err)}. {_record_fix(where)}") from None
        if batch is None:
            return
        if text_field not in batch:
            raise fail(f"{where} has no field {text_field!r}; its fields are {', '.join(batch)}. Pass --text-field.")
        for text in batch[text_field]:
            if text is not None and not isinstance(text, str):
                raise _not_text(where, index, text_field, text)
            if _is_empty(text):
                stats.empty_documents += 1
            else:
                yield Document(f"{key}:{index}", text, input_index)
            index += 1


def _not_text(where: str, index: int, text_field: str, value: Any) -> UserError:
    """The error for a record whose text field holds a number, a list or an object, naming the record: the
    column's type (``datasets`` infers ``Json`` for mixed values) would not say which one."""
    record = f"line {index + 1}" if where.endswith(".jsonl") else f"record {index} (counted from 0)"
    shown = repr(value)
    shown = shown if len(shown) <= 60 else f"{shown[:57]}..."
    return fail(f"{where}, {record}: field {text_field!r} holds {type(value).__name__} {shown}, not text. Each "
                f"record's {text_field!r} must be a string (or null, skipped as an empty document): fix that record, "
                "leave the file out of --input, or pass --text-field if another field holds the text.")
