"""Turn a text corpus into the token files that training reads, streaming: memory does not grow with the corpus.

An output folder (``format_version`` 2, :data:`lmrecipe.data.format.FORMAT_VERSION`) holds:

- ``train.bin`` / ``val.bin``: flat little-endian token ids (``uint16`` when the vocabulary has at most 65536
  entries, else ``uint32``); every document is followed by one EOS token.
- ``train.idx`` / ``val.idx``: the document index, little-endian ``uint64`` token offsets into the split's
  ``.bin``: ``n_documents + 1`` entries, ``idx[0] == 0``, document ``i`` (its EOS included) is tokens
  ``[idx[i], idx[i + 1])`` and ``idx[-1] == n_tokens``. Documents are in reading order.
- ``meta.json``: tokenizer, ``vocab_size``, ``eos_id``, ``dtype``, ``source``, ``val_fraction``, ``seed`` and per
  split ``n_tokens``, ``n_documents``, ``max_token_id`` (the largest id in the split, so start-up checks need not
  read the tokens) and the ``sha256`` of the .bin file. ``inputs`` lists each ``--input`` (or the Hub dataset, or
  the embedded corpus) with, per split, its contiguous range of documents ``[first, stop)`` and its token count,
  so that tokens can be attributed to their input without re-tokenizing. ``skipped`` counts empty documents and
  files that are not UTF-8 text; ``tokenizer_sample`` says what a trained BPE was trained on. Everything except
  the ``timing`` key is a pure function of the inputs and arguments, so two runs can be compared.
- the tokenizer files (``save_pretrained``), loadable with ``AutoTokenizer.from_pretrained(folder)``.

Streaming: documents are read one file or one record batch at a time (jsonl/json/parquet and Hub datasets through
``datasets`` with ``streaming=True``), tokenized in chunks of about ``_CHUNK_CHARS`` characters with at most
``2 * num_proc`` chunks in flight, and appended to the output files. Peak memory is the tokenizer processes, a
few chunks, and the largest single document (a plain-text file is read whole), not the corpus. A trained BPE is
trained on a bounded sample, the first ``tokenizer_sample_mb`` MB (UTF-8) of train documents in reading order,
which is one extra read of that prefix of the corpus.

The train/val split is per document: a document goes to val when the first 8 bytes of sha256 of
``"<seed>:<key>"``, read as a fraction of 2**64, are below ``val_fraction``. So a document's split depends only
on its key and the seed: not on the order in which documents are read, on the other documents, or on how many
processes tokenize them.

The folder is built next to its destination (``<output>.tmp-<pid>``) and renamed into place only when complete,
with ``meta.json`` written last: a reader never sees a half-written folder. An interrupted preparation does not
resume; run it again and it restarts from the beginning. A killed process (SIGKILL, power loss) can leave its
``.tmp-<pid>`` folder behind; it has no ``meta.json``, so training refuses it, and it can be deleted.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import multiprocessing
import os
import sys
import sysconfig
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import numpy as np

from lmrecipe.data.format import FORMAT_VERSION, INDEX_DTYPE, SPLITS
from lmrecipe.errors import UserError, fail
from lmrecipe.fileio import building_dir

logger = logging.getLogger(__name__)

EOS_TOKEN = "<|endoftext|>"
TRAINED_TOKENIZER = "bpe-trained"
"""``meta.json`` ``tokenizer`` value when the tokenizer was trained here rather than given."""

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

#: Byte-level BPE needs its 256 byte tokens and EOS, plus at least one merge to be a BPE at all.
MIN_TRAINED_VOCAB_SIZE = 256 + 1 + 1


# Documents are sent to tokenizer workers in chunks this large: big enough that pickling and IPC stay cheap
# next to tokenizing, small enough that the progress bar moves and both cores stay busy on a small corpus.
_CHUNK_CHARS = 256 * 1024
_CHUNK_DOCS = 1024
# Chunks submitted but not yet written, per tokenizer process: enough to keep every worker busy while the
# parent reads the next documents, few enough that memory stays a handful of chunks.
_IN_FLIGHT_PER_PROC = 2
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
    ):
        if inputs and hub_dataset:
            raise fail("Pass either --input or --hub-dataset, not both.")
        if max_documents is not None and max_documents < 1:
            raise fail(f"--max-documents must be at least 1, got {max_documents}.")
        self.inputs = [Path(raw) for raw in inputs]
        self.hub_dataset = hub_dataset
        self.text_field = text_field
        self.max_documents = max_documents
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
        elif self.inputs:
            for index, path in enumerate(self.inputs):
                if path.is_dir():
                    unsupported = [0]
                    for rel, file in _walk_supported(path, path, unsupported):
                        yield from _file_documents(file, rel, index, self.text_field, stats)
                    if unsupported[0]:
                        logger.info("%s: skipped %d files of unsupported types", path, unsupported[0])
                else:
                    yield from _file_documents(path, path.name, index, self.text_field, stats)
        else:
            root = _stdlib_root()
            for path in embedded_corpus_files():
                yield from _file_documents(path, path.relative_to(root).as_posix(), 0, self.text_field, stats)


@dataclass
class Corpus:
    """Documents in reading order, held in memory. ``keys[i]`` names ``texts[i]`` (relative path, or ``path:record``)."""

    keys: list[str] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    source: str = ""

    def __len__(self) -> int:
        return len(self.texts)


def embedded_corpus_files() -> list[Path]:
    """The default corpus: ``*.py`` and ``*.txt`` of the running Python's standard library.

    Third-party packages (``site-packages``, ``dist-packages``) and the test suites (``test``, ``tests``,
    ``idlelib``) are left out. Sorted by path relative to the standard library folder.
    """
    root = _stdlib_root()
    files = []
    # os.walk with pruning, not rglob: site-packages can hold gigabytes that would be walked only to be dropped.
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [name for name in dirnames if name not in _EMBEDDED_EXCLUDED_DIRS]
        files.extend(
            Path(dirpath, name) for name in filenames
            if Path(name).suffix in _EMBEDDED_SUFFIXES and os.path.isfile(os.path.join(dirpath, name))
        )
    return sorted(files, key=lambda path: path.relative_to(root).as_posix())


def load_corpus(
    inputs: Sequence[str | os.PathLike] = (),
    hub_dataset: str | None = None,
    text_field: str = "text",
    max_documents: int | None = None,
) -> Corpus:
    """The documents of :class:`DocumentSource` held in memory: for small corpora, tests and benchmarks only.

    :func:`prepare` never calls it; it streams the same documents in the same order.
    """
    source = DocumentSource(inputs, hub_dataset, text_field, max_documents)
    stats = ReadStats()
    corpus = Corpus()
    for doc in source.documents(stats):
        corpus.keys.append(doc.key)
        corpus.texts.append(doc.text)
    corpus.source = source.describe(stats)
    if not corpus.texts:
        raise _no_documents(corpus.source)
    return corpus


def split_of(key: str, val_fraction: float, seed: int = 0) -> str:
    """``"val"`` when sha256 of ``"<seed>:<key>"`` (first 8 bytes, as a fraction of 2**64) is below ``val_fraction``.

    A document's split depends only on its key and the seed, so it stays in its split when other documents are
    added, removed or reordered; about ``val_fraction`` of the documents go to val.
    """
    digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    return "val" if int.from_bytes(digest[:8], "big") < val_fraction * 2**64 else "train"


def split_documents(keys: Sequence[str], val_fraction: float, seed: int = 0) -> tuple[list[int], list[int]]:
    """(train, val) index lists of ``keys``, each in the original order, by :func:`split_of`."""
    _check_val_fraction(val_fraction)
    splits = [split_of(key, val_fraction, seed) for key in keys]
    return ([i for i, s in enumerate(splits) if s == "train"], [i for i, s in enumerate(splits) if s == "val"])


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int, length: int | None = None):
    """Train a byte-level BPE with ``vocab_size`` entries (``<|endoftext|>`` included); deterministic.

    ``texts`` is consumed once, as it comes: it may be a generator. Returns a
    ``transformers.PreTrainedTokenizerFast`` whose eos/bos/unk/pad token is ``<|endoftext|>``. Byte level with
    no prefix space and no clean-up makes ``decode(encode(text)) == text`` for every text.
    """
    _check_vocab_size(vocab_size)
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        # The full byte alphabet, not only bytes seen in training, so any text can be encoded later.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer, length=length)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=EOS_TOKEN,
        bos_token=EOS_TOKEN,
        unk_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        clean_up_tokenization_spaces=False,
    )


def prepare(
    *,
    output: str | os.PathLike,
    inputs: Sequence[str | os.PathLike] = (),
    hub_dataset: str | None = None,
    text_field: str = "text",
    tokenizer: str | None = None,
    vocab_size: int = 8192,
    tokenizer_sample_mb: float = 256.0,
    val_fraction: float = 0.02,
    num_proc: int | None = None,
    max_documents: int | None = None,
    overwrite: bool = False,
    seed: int = 0,
) -> dict[str, Any]:
    """Stream a corpus, build or load a tokenizer, and write a prepared data folder at ``output``.

    Memory stays bounded whatever the corpus size (see the module docstring). Nothing appears at ``output``
    unless the whole preparation succeeds; after an interruption, run it again: it starts over.

    Args:
        output: folder to create; it must not exist unless ``overwrite``.
        inputs: files or folders (see :class:`DocumentSource`); empty with no ``hub_dataset`` means the embedded
            Python standard library corpus.
        hub_dataset: Hugging Face Hub dataset name, streamed with
            ``datasets.load_dataset(name, split="train", streaming=True)``.
        text_field: record field (jsonl/json/parquet/hub) that holds the document text.
        tokenizer: Hugging Face tokenizer name or folder; None trains a byte-level BPE on the train split.
        vocab_size: entries of the trained BPE, special token included (ignored with ``tokenizer``).
        tokenizer_sample_mb: a trained BPE learns from the first this many MB (10**6 bytes of UTF-8) of train
            documents, in reading order (whole documents; the last one may cross the limit). Ignored with
            ``tokenizer``.
        val_fraction: share of documents held out for validation, in (0, 0.5].
        num_proc: tokenizer processes; None means every CPU core. 1 tokenizes in this process, where the
            ``tokenizers`` library may still spread a batch over its own threads.
        max_documents: keep only the first N non-empty documents.
        overwrite: replace an existing ``output`` (only once the new folder is complete).
        seed: salt of the train/val split hash.

    Returns:
        The dict written to ``meta.json``.
    """
    started = time.perf_counter()
    out_dir = Path(output)
    _check_val_fraction(val_fraction)
    if tokenizer is None:
        _check_vocab_size(vocab_size)
        if not tokenizer_sample_mb > 0:
            raise fail(f"--tokenizer-sample-mb must be positive, got {tokenizer_sample_mb}.")
    num_proc = (os.cpu_count() or 1) if num_proc is None else num_proc
    if num_proc < 1:
        raise fail(f"--num-proc must be at least 1, got {num_proc}.")
    source = DocumentSource(inputs, hub_dataset, text_field, max_documents)
    _check_output_free(out_dir, overwrite)
    _warn_stale_temp_dirs(out_dir)
    # A given tokenizer is loaded before the corpus is read, so a wrong name fails in seconds.
    given_tokenizer = _load_hf_tokenizer(tokenizer) if tokenizer is not None else None

    with building_dir(out_dir, overwrite) as tmp_dir:
        meta = _build(tmp_dir, source, tokenizer, given_tokenizer, vocab_size, tokenizer_sample_mb, num_proc,
                      val_fraction, seed)
        _check_output_free(out_dir, overwrite)  # again: it may have appeared while we worked
    logger.info("wrote %s in %.1fs", out_dir, time.perf_counter() - started)
    return meta


def _build(
    tmp_dir: Path,
    source: DocumentSource,
    tokenizer: str | None,
    given_tokenizer,
    vocab_size: int,
    tokenizer_sample_mb: float,
    num_proc: int,
    val_fraction: float,
    seed: int,
) -> dict[str, Any]:
    """Write tokenizer, .bin/.idx files and, last, meta.json into ``tmp_dir``; return the meta dict.

    ``given_tokenizer`` is the loaded ``tokenizer`` (a name), or None to train a BPE on a sample of the train split.
    """
    started = time.perf_counter()
    sample = None
    if given_tokenizer is None:
        sample = {"max_mb": tokenizer_sample_mb, "n_documents": 0, "n_bytes": 0}
        texts = _tokenizer_sample(source, val_fraction, seed, sample)
        logger.info("training byte-level BPE, vocab_size %d, on the first %g MB of train documents", vocab_size,
                    tokenizer_sample_mb)
        hf_tokenizer = train_bpe_tokenizer(texts, vocab_size)
        logger.info("BPE sample: %d train documents, %.1f MB", sample["n_documents"], sample["n_bytes"] / 1e6)
        if len(hf_tokenizer) < vocab_size:
            logger.warning("the corpus only supports %d BPE tokens (asked for %d)", len(hf_tokenizer), vocab_size)
    else:
        hf_tokenizer = given_tokenizer
    eos_id = hf_tokenizer.eos_token_id
    vocab_size = len(hf_tokenizer)
    hf_tokenizer.save_pretrained(tmp_dir)
    tokenizer_seconds = time.perf_counter() - started
    logger.info("tokenizer %s: %d tokens, eos_id %d (%.1fs)", tokenizer or TRAINED_TOKENIZER, vocab_size, eos_id,
                tokenizer_seconds)

    dtype = "uint16" if vocab_size <= 2**16 else "uint32"
    started = time.perf_counter()
    stats = ReadStats()
    spec = _EncoderSpec(str(tmp_dir), given_tokenizer is None, eos_id, vocab_size, dtype)
    splits, inputs = _tokenize_to_files(tmp_dir, source.documents(stats), spec, num_proc, val_fraction, seed,
                                        len(source.names))
    tokenize_seconds = time.perf_counter() - started
    described = source.describe(stats)
    _check_splits(splits, stats, described, val_fraction)
    n_tokens = sum(split["n_tokens"] for split in splits.values())
    logger.info(
        "read %d documents (%.1fM characters) from %s; skipped %d empty documents and %d files that are not "
        "UTF-8 text", stats.n_documents, stats.n_chars / 1e6, described, stats.empty_documents, stats.not_text_files,
    )
    logger.info(
        "tokenized: train %d documents, %d tokens; val %d documents, %d tokens; %d tokens in %.1fs "
        "(%.0f tokens/s, reading included, %d processes)",
        splits["train"]["n_documents"], splits["train"]["n_tokens"], splits["val"]["n_documents"],
        splits["val"]["n_tokens"], n_tokens, tokenize_seconds, n_tokens / tokenize_seconds, num_proc,
    )
    meta = {
        "format_version": FORMAT_VERSION,
        "tokenizer": tokenizer or TRAINED_TOKENIZER,
        "vocab_size": vocab_size,
        "eos_id": eos_id,
        "dtype": dtype,
        "source": described,
        "val_fraction": val_fraction,
        "seed": seed,
        "splits": splits,
        "inputs": [{"name": name, **per_split} for name, per_split in zip(source.names, inputs)],
        "skipped": {"empty_documents": stats.empty_documents, "not_text_files": stats.not_text_files},
        "tokenizer_sample": sample,
        # Everything that differs between two identical runs lives here, so the rest can be compared.
        "timing": {
            "num_proc": num_proc,
            "tokenizer_seconds": round(tokenizer_seconds, 3),
            "tokenize_seconds": round(tokenize_seconds, 3),
            "tokens_per_sec": round(n_tokens / tokenize_seconds, 1),
        },
    }
    # Last: a folder without meta.json is not a data folder, whatever else it holds.
    (tmp_dir / "meta.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    return meta


def _tokenizer_sample(source: DocumentSource, val_fraction: float, seed: int, sample: dict) -> Iterator[str]:
    """Train documents from the start of ``source`` until ``sample["max_mb"]`` MB; counts go into ``sample``.

    The first document is read before the generator is returned, so an input without documents fails here,
    with the message the tokenizing pass would give, rather than after training a BPE on nothing.
    """
    stats = ReadStats()
    train_texts = (doc.text for doc in source.documents(stats) if split_of(doc.key, val_fraction, seed) == "train")
    first = next(train_texts, None)
    if first is None:
        described = source.describe(stats)
        if stats.n_documents == 0:
            raise _no_documents(described)
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


@dataclass(frozen=True)
class _EncoderSpec:
    """What a tokenizer worker needs to build its encoder; small and picklable."""

    tokenizer_dir: str
    trained: bool
    eos_id: int
    vocab_size: int
    dtype: str


class _ChunkEncoder:
    """Encodes a list of documents into the bytes of one id array: each document's ids, then EOS.

    Special-token text inside a document (a literal ``<|endoftext|>``) is encoded as plain text, so EOS in
    the stream only ever marks a document boundary.
    """

    def __init__(self, spec: _EncoderSpec):
        self.spec = spec
        if spec.trained:
            # The trained tokenizer has no normalizer or post-processor, so its `tokenizers` backend encodes
            # exactly like the transformers wrapper, without importing transformers into every worker.
            from tokenizers import Tokenizer

            self._backend = Tokenizer.from_file(str(Path(spec.tokenizer_dir) / "tokenizer.json"))
            self._backend.encode_special_tokens = True
        else:
            from transformers import AutoTokenizer

            self._hf = AutoTokenizer.from_pretrained(spec.tokenizer_dir)

    def encode(self, texts: list[str]) -> list[list[int]]:
        if self.spec.trained:
            return [encoding.ids for encoding in self._backend.encode_batch_fast(texts, add_special_tokens=False)]
        # verbose=False: documents are longer than model_max_length by design, the warning would be noise.
        return self._hf(texts, add_special_tokens=False, split_special_tokens=True, verbose=False)["input_ids"]

    def __call__(self, texts: list[str]) -> tuple[bytes, np.ndarray, int]:
        """(the ids' bytes, each document's length in tokens with its EOS, the largest id)."""
        flat: list[int] = []
        lengths = np.empty(len(texts), dtype=np.int64)
        for i, ids in enumerate(self.encode(texts)):
            flat.extend(ids)
            flat.append(self.spec.eos_id)
            lengths[i] = len(ids) + 1
        array = np.asarray(flat, dtype=np.int64)
        top = int(array.max())  # never empty: every document adds its EOS
        # A wrong id would be silently wrapped by the cast below and train on garbage.
        if array.min() < 0 or top >= self.spec.vocab_size:
            raise RuntimeError(
                f"tokenizer produced ids in [{array.min()}, {top}], outside [0, {self.spec.vocab_size})"
            )
        return array.astype(np.dtype(self.spec.dtype).newbyteorder("<")).tobytes(), lengths, top


# Set once in each tokenizer worker process by `_init_worker`: a Pool initializer is how every worker gets
# its own tokenizer without pickling one into each task.
_worker_encoder: _ChunkEncoder | None = None


def _init_worker(spec: _EncoderSpec) -> None:
    global _worker_encoder
    # Each worker is one of num_proc processes: threads inside it would oversubscribe the cores.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker_encoder = _ChunkEncoder(spec)


def _encode_in_worker(texts: list[str]) -> tuple[bytes, np.ndarray, int]:
    return _worker_encoder(texts)


class _SplitWriter:
    """Appends encoded chunks of one split to ``<split>.bin`` and their document ends to ``<split>.idx``.

    Also attributes documents and tokens to inputs: the documents of one input are consecutive in reading
    order, so each input holds one range of the split's documents.
    """

    def __init__(self, folder: Path, split: str, dtype: str, n_inputs: int):
        self.itemsize = np.dtype(dtype).itemsize
        self.bin = open(folder / f"{split}.bin", "wb")
        self.idx = open(folder / f"{split}.idx", "wb")
        self.idx.write(np.zeros(1, dtype=INDEX_DTYPE).tobytes())
        self.digest = hashlib.sha256()
        self.n_tokens = 0
        self.n_documents = 0
        self.max_token_id: int | None = None
        self.inputs = [{"documents": [0, 0], "n_tokens": 0} for _ in range(n_inputs)]

    def append(self, data: bytes, lengths: np.ndarray, top: int, input_indices: list[int]) -> None:
        self.bin.write(data)
        self.digest.update(data)
        self.idx.write((self.n_tokens + np.cumsum(lengths)).astype(INDEX_DTYPE).tobytes())
        inputs = np.asarray(input_indices)
        for index in np.unique(inputs):
            positions = np.flatnonzero(inputs == index)
            entry = self.inputs[index]
            if entry["documents"][1] == 0:
                entry["documents"][0] = self.n_documents + int(positions[0])
            entry["documents"][1] = self.n_documents + int(positions[-1]) + 1
            entry["n_tokens"] += int(lengths[positions].sum())
        self.n_tokens += len(data) // self.itemsize
        self.n_documents += len(lengths)
        self.max_token_id = top if self.max_token_id is None else max(self.max_token_id, top)

    def close(self) -> None:
        self.bin.close()
        self.idx.close()

    def stats(self) -> dict[str, Any]:
        return {"n_tokens": self.n_tokens, "n_documents": self.n_documents, "max_token_id": self.max_token_id,
                "sha256": self.digest.hexdigest()}


def _tokenize_to_files(
    out_dir: Path,
    documents: Iterator[Document],
    spec: _EncoderSpec,
    num_proc: int,
    val_fraction: float,
    seed: int,
    n_inputs: int,
) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """Tokenize the documents into ``<split>.bin`` and ``<split>.idx``, streaming.

    Returns per split its n_tokens, n_documents, max_token_id and sha256, and per input its document range and
    tokens in each split. Chunks are written in the order they were submitted, so the files are the same for
    any ``num_proc`` and any chunk size.
    """
    from tqdm.auto import tqdm

    writers = {split: _SplitWriter(out_dir, split, spec.dtype, n_inputs) for split in SPLITS}
    pending: dict[str, tuple[list[str], list[int]]] = {split: ([], []) for split in SPLITS}
    pending_chars = dict.fromkeys(SPLITS, 0)
    in_flight: deque = deque()
    max_in_flight = _IN_FLIGHT_PER_PROC * num_proc
    pool = None
    encoder = None
    progress = tqdm(unit="doc", desc="tokenizing")

    def write(split: str, input_indices: list[int], result) -> None:
        data, lengths, top = result
        writers[split].append(data, lengths, top, input_indices)
        progress.update(len(lengths))

    def submit(split: str) -> None:
        texts, input_indices = pending[split]
        pending[split], pending_chars[split] = ([], []), 0
        if pool is None:
            write(split, input_indices, encoder(texts))
            return
        while len(in_flight) >= max_in_flight:
            write(*in_flight[0][:2], in_flight[0][2].get())
            in_flight.popleft()
        in_flight.append((split, input_indices, pool.apply_async(_encode_in_worker, (texts,))))

    try:
        if num_proc == 1:
            encoder = _ChunkEncoder(spec)
        else:
            # spawn, not fork: the parent may already run tokenizers' thread pool (BPE training), and forking
            # a threaded process can deadlock.
            pool = multiprocessing.get_context("spawn").Pool(num_proc, initializer=_init_worker, initargs=(spec,))
        for doc in documents:
            split = split_of(doc.key, val_fraction, seed)
            texts, input_indices = pending[split]
            texts.append(doc.text)
            input_indices.append(doc.input_index)
            pending_chars[split] += len(doc.text)
            if pending_chars[split] >= _CHUNK_CHARS or len(texts) >= _CHUNK_DOCS:
                submit(split)
        for split in SPLITS:
            if pending[split][0]:
                submit(split)
        while in_flight:
            write(*in_flight[0][:2], in_flight[0][2].get())
            in_flight.popleft()
    finally:
        progress.close()
        if pool is not None:
            pool.terminate()
            pool.join()
        for writer in writers.values():
            writer.close()
    inputs = [{split: writers[split].inputs[i] for split in SPLITS} for i in range(n_inputs)]
    return {split: writer.stats() for split, writer in writers.items()}, inputs


def _check_splits(splits: dict[str, dict[str, Any]], stats: ReadStats, source: str, val_fraction: float) -> None:
    if stats.n_documents == 0:
        raise _no_documents(source)
    for split in SPLITS:
        if splits[split]["n_documents"] == 0:
            raise _empty_split(split, stats.n_documents, source, val_fraction)


def _no_documents(source: str) -> UserError:
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


def _load_hf_tokenizer(name: str):
    # A Hub id is "name" or "org/name"; anything else is a folder, and a missing one deserves a plain message.
    looks_like_path = name.startswith(("/", ".", "~")) or name.count("/") > 1
    if looks_like_path and not Path(name).expanduser().exists():
        raise fail(f"--tokenizer {name}: no such folder. Pass an existing tokenizer folder or a Hub tokenizer name.")
    from transformers import AutoTokenizer

    try:
        hf_tokenizer = AutoTokenizer.from_pretrained(Path(name).expanduser() if looks_like_path else name)
    except Exception as err:  # transformers raises OSError, ValueError, HTTP errors... all mean "not loadable"
        # Not a dedented template: the library's message may span lines with its own indentation.
        raise fail(
            f"Could not load tokenizer {name!r}: {err}\nPass a local tokenizer folder (this machine may be "
            "offline), or leave out --tokenizer to train a byte-level BPE on the corpus."
        ) from err
    if hf_tokenizer.eos_token_id is None:
        raise fail(
            f"""
            Tokenizer {name!r} has no EOS token, which marks document boundaries in the token stream. Use a
            tokenizer with an eos_token, or leave out --tokenizer to train one.
            """
        )
    return hf_tokenizer


def _check_val_fraction(val_fraction: float) -> None:
    if not 0 < val_fraction <= 0.5:
        raise fail(f"--val-fraction must be in (0, 0.5], got {val_fraction}; 0.02 holds out 2% of documents.")


def _check_vocab_size(vocab_size: int) -> None:
    if vocab_size < MIN_TRAINED_VOCAB_SIZE:
        raise fail(
            f"""
            --vocab-size {vocab_size} is too small to train a byte-level BPE: it needs 256 byte tokens,
            {EOS_TOKEN} and at least one merge, so at least {MIN_TRAINED_VOCAB_SIZE}.
            """
        )


def _check_output_free(out_dir: Path, overwrite: bool) -> None:
    if (out_dir.exists() or out_dir.is_symlink()) and not overwrite:
        raise fail(f"{out_dir} already exists. Pass --overwrite to replace it, or choose another --output folder.")


def _warn_stale_temp_dirs(out_dir: Path) -> None:
    # Not deleted here: another preparation into the same output may be running right now.
    stale = sorted(out_dir.parent.glob(f"{out_dir.name}.tmp-*")) if out_dir.parent.is_dir() else []
    if stale:
        logger.warning(
            "%s: left by an interrupted preparation (no meta.json, so training refuses them); delete them "
            "unless another preparation into %s is running", ", ".join(map(str, stale)), out_dir,
        )


def _stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


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

    try:
        return datasets.load_dataset(kind, data_files=str(path), split="train", streaming=True)
    except Exception as err:  # datasets wraps parse errors in several types; all mean "bad file"
        raise fail(f"Could not read {path} as {kind} records: {_describe(err)}") from err


def _describe(err: BaseException) -> str:
    """The message of ``err`` and of the errors that caused it: wrappers often hide the useful part."""
    messages = []
    while err is not None and len(messages) < 4:
        messages.append(str(err) or type(err).__name__)
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
    feature = dataset.features[text_field] if dataset.features is not None else None
    if feature is not None and getattr(feature, "dtype", None) not in ("string", "large_string", "null"):
        raise fail(f"{where}: field {text_field!r} holds {feature}, not text. Pass --text-field.")
    if columns is not None:
        dataset = dataset.select_columns([text_field])
    index = 0
    batches = iter(dataset.iter(batch_size=_RECORD_BATCH))
    while True:
        try:
            batch = next(batches, None)
        except Exception as err:  # a parse error deep in the file surfaces here, in one of several types
            raise fail(f"Could not read {where} (record {index} on): {_describe(err)}") from err
        if batch is None:
            return
        if text_field not in batch:
            raise fail(f"{where} has no field {text_field!r}; its fields are {', '.join(batch)}. Pass --text-field.")
        for text in batch[text_field]:
            if text is not None and not isinstance(text, str):
                raise fail(f"{where}: record {index} field {text_field!r} holds {type(text).__name__}, not text. "
                           "Pass --text-field.")
            if _is_empty(text):
                stats.empty_documents += 1
            else:
                yield Document(f"{key}:{index}", text, input_index)
            index += 1
